"""``kvstrata bench crash``: the crash-consistency harness (issue 30, acceptance 4). A multi-session
workload runs under a recorder of its file operations (:mod:`.recorder`), once per durability
mode; the on-disk states a crash could leave at many points of it are built (:mod:`.states`),
reopened and checked (:mod:`.check`); see :mod:`.runner`."""
