from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner, Result

import kvstrata
from kvstrata import KVStore, StoreConfig
from kvstrata.cli.main import app
from kvstrata.cli.progress import progress_bar
from kvstrata.integrations.transformers.model import save_tiny_llama
from kvstrata.policy.ladder import CodecLadder

from conftest import LAYOUT, token_kv

runner = CliRunner()


def _make_store(root: Path) -> None:
    config = StoreConfig(
        l1_budget_bytes=4 * LAYOUT.bytes_per_block, l2_budget_bytes=1 << 20, ladder=CodecLadder.exact()
    )
    with KVStore(root, LAYOUT, model_fingerprint=b"test-model", config=config) as store:
        for sid in ("alpha", "beta"):
            s = store.create_session(sid, pinned=sid == "beta")
            tokens = list(range(10))
            store.append(s, tokens, token_kv(LAYOUT, tokens))
            store.checkpoint(s)
            store.load(s)


def test_store_stats_json(tmp_path: Path) -> None:
    _make_store(tmp_path)
    result = runner.invoke(app, ["store", "stats", "--store", str(tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    stats = json.loads(result.output)
    tiers = {t["tier"]: t for t in stats["tiers"]}
    assert stats["sessions"] == 2
    assert tiers["L3"]["blocks"] == 3  # two shared full blocks + one shared tail
    assert tiers["L1"]["hits"] > 0 and tiers["L1"]["live"] is False  # counters persisted by the writer
    assert tiers["L2"]["budget_bytes"] > 0 and "fragmentation_bytes" in tiers["L2"]
    table = runner.invoke(app, ["store", "stats", "--store", str(tmp_path)])
    assert table.exit_code == 0 and "L3" in table.output


def test_sessions_commands(tmp_path: Path) -> None:
    _make_store(tmp_path)
    listed = runner.invoke(app, ["sessions", "list", "--store", str(tmp_path), "--json"])
    assert [s["id"] for s in json.loads(listed.output)] == ["alpha", "beta"]
    shown = runner.invoke(app, ["sessions", "show", "alpha", "--store", str(tmp_path), "--json"])
    info = json.loads(shown.output)
    assert info["num_tokens"] == 10 and [b["tier"] for b in info["blocks"]] == ["L3"] * 3
    forked = runner.invoke(app, ["sessions", "fork", "alpha", "gamma", "--store", str(tmp_path)])
    assert forked.exit_code == 0 and "10 tokens shared" in forked.output
    assert runner.invoke(app, ["sessions", "delete", "alpha", "--store", str(tmp_path)]).exit_code == 0
    missing = runner.invoke(app, ["sessions", "delete", "alpha", "--store", str(tmp_path)])
    assert missing.exit_code == 1 and "no session" in missing.output
    listed = runner.invoke(app, ["sessions", "list", "--store", str(tmp_path), "--json"])
    assert [s["id"] for s in json.loads(listed.output)] == ["beta", "gamma"]


def test_gc_command_and_missing_store(tmp_path: Path) -> None:
    _make_store(tmp_path)
    result = runner.invoke(app, ["gc", "--store", str(tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["blocks_deleted"] == 0
    nowhere = runner.invoke(app, ["store", "stats", "--store", str(tmp_path / "nope")])
    assert nowhere.exit_code == 1 and "no kvstrata store" in nowhere.output


def test_demo_runs_and_verifies(tmp_path: Path) -> None:
    result = runner.invoke(
        app,
        [
            "store",
            "demo",
            "--store",
            str(tmp_path / "demo"),
            "--agents",
            "3",
            "--turns",
            "2",
            "--system-tokens",
            "128",
            "--turn-tokens",
            "40",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.output[result.output.index("{") :])
    assert all(a["bit_exact"] for a in data["agents"]) and data["dedup_ratio"] > 1


# -- the command line as a newcomer uses it: `kvstrata ...` processes, one after another ------------

KVSTRATA = str(Path(sys.executable).parent / "kvstrata")


@pytest.fixture(scope="module")
def cli_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The environment of a shell after `make`: the tiny random Llama as the default model."""
    root = tmp_path_factory.mktemp("cli")
    src = str(Path(kvstrata.__file__).resolve().parents[1])  # the code under test wins
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTRATA_")}
    env.update(
        PYTHONPATH=os.pathsep.join(p for p in (src, env.get("PYTHONPATH", "")) if p),
        KVSTRATA_MODEL=str(save_tiny_llama(root / "tiny", seed=0)),
        KVSTRATA_MODEL_CACHE=str(root / "model-cache"),
        KVSTRATA_STORE=str(root / "unused-default-store"),
    )
    return env


def kv(env: dict[str, str], *args: str, ok: bool = True) -> subprocess.CompletedProcess[str]:
    """Run `kvstrata ARGS` with stdout and stderr piped (not a terminal), as a script or a log would."""
    done = subprocess.run([KVSTRATA, *args], env=env, capture_output=True, text=True, timeout=300)
    if ok:
        assert done.returncode == 0, f"kvstrata {' '.join(args)}: exit {done.returncode}\n{done.stderr}"
    return done


@pytest.fixture(scope="module")
def chatted(cli_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`kvstrata chat --store X` twice in one session, as the README's first steps do."""
    store = tmp_path_factory.mktemp("chatted") / "kv"
    first = kv(cli_env, "chat", "--store", str(store), "--session", "agent-7", "--max-new-tokens", "4", "Hi!")
    assert first.stdout.strip()
    second = kv(
        cli_env, "chat", "--store", str(store), "-s", "agent-7", "--max-new-tokens", "4", "--json", "Again"
    )
    reply = json.loads(second.stdout)  # stdout is the JSON and nothing else
    assert reply["cached_tokens"] > 0  # the first turn's KV came from the store
    # --json and a stderr that is not a terminal: no progress bar ("Loading weights: ...") or other noise
    assert second.stderr == ""
    return store


def test_every_command_finds_the_store_chat_wrote_under_the_same_store_option(
    chatted: Path, cli_env: dict[str, str]
) -> None:
    store = str(chatted)
    sessions = json.loads(kv(cli_env, "sessions", "list", "--store", store, "--json").stdout)
    assert [s["id"] for s in sessions] == ["agent-7"] and sessions[0]["num_tokens"] > 0
    layout_dir = Path(sessions[0]["store"])
    assert layout_dir.parent == chatted and (layout_dir / "index.sqlite").is_file()
    shown = json.loads(kv(cli_env, "sessions", "show", "agent-7", "--store", store, "--json").stdout)
    assert shown["num_tokens"] == sessions[0]["num_tokens"] and shown["blocks"]
    stats = json.loads(kv(cli_env, "store", "stats", "--store", store, "--json").stdout)
    assert stats["sessions"] == 1
    assert "0 sessions expired" in kv(cli_env, "gc", "--store", store).stdout
    # $KVSTRATA_STORE means the same as --store; the store itself (DIR/<layout>) is accepted too
    assert "agent-7" in kv({**cli_env, "KVSTRATA_STORE": store}, "sessions", "show", "agent-7").stdout
    direct = runner.invoke(app, ["store", "stats", "--store", str(layout_dir), "--json"])
    assert direct.exit_code == 0 and json.loads(direct.stdout)["sessions"] == 1


def test_a_store_root_with_two_model_layouts(chatted: Path, cli_env: dict[str, str], tmp_path: Path) -> None:
    root = tmp_path / "kv"
    shutil.copytree(chatted, root)
    other_model = save_tiny_llama(tmp_path / "tiny-3-layers", seed=1, num_layers=3)
    kv(
        cli_env,
        "chat",
        "--store",
        str(root),
        "--model",
        str(other_model),
        "-s",
        "other",
        "--max-new-tokens",
        "2",
        "Hi",
    )
    # a command acting on one store names the choices and asks for --layout, in one line
    stats = kv(cli_env, "store", "stats", "--store", str(root), ok=False)
    assert stats.returncode == 1 and "Traceback" not in stats.stderr
    assert len(stats.stderr.strip().splitlines()) == 1 and "--layout" in stats.stderr

    def cli(*args: str) -> Result:
        return runner.invoke(app, [*args, "--store", str(root)])

    sessions = json.loads(cli("sessions", "list", "--json").stdout)
    assert sorted(s["id"] for s in sessions) == ["agent-7", "other"]
    stores = {Path(s["store"]).name: s["id"] for s in sessions}
    assert len(stores) == 2 and all(name in stats.stderr for name in stores)
    table = cli("sessions", "list").stdout
    assert all(name in table for name in stores)  # a layout column names each session's store
    name_of_other = next(name for name, sid in stores.items() if sid == "other")
    chosen = cli("store", "stats", "--layout", name_of_other[:6], "--json")
    assert json.loads(chosen.stdout)["layout"]["num_layers"] == 3
    assert cli("store", "stats", "--layout", "zz").exit_code == 1
    # show, fork and delete find the store that holds the session
    assert json.loads(cli("sessions", "show", "other", "--json").stdout)["store"].endswith(name_of_other)
    assert cli("sessions", "fork", "agent-7", "agent-8").exit_code == 0
    assert cli("sessions", "delete", "other").exit_code == 0
    missing = cli("sessions", "show", "other")
    assert missing.exit_code == 1 and "no session 'other'" in missing.stderr
    assert sorted(s["id"] for s in json.loads(cli("sessions", "list", "--json").stdout)) == [
        "agent-7",
        "agent-8",
    ]
    assert cli("gc", "--layout", name_of_other).exit_code == 0


def test_piped_tables_are_printed_whole(chatted: Path, cli_env: dict[str, str]) -> None:
    """Into a pipe, rich would cut tables at 80 columns ("namesp…", "blo…")."""
    store = str(chatted)
    for args, headers in (
        (["sessions", "list"], ["namespace", "tokens", "blocks", "priority", "pinned", "last access"]),
        (["store", "stats"], ["tier", "blocks", "bytes", "budget", "promoted", "fragmentation", "by codec"]),
    ):
        out = kv(cli_env, *args, "--store", store).stdout
        assert "…" not in out, out
        assert all(header in out for header in headers), out
    assert "agent-7" in out or "identity" in out


@pytest.mark.parametrize("command", ["chat", "serve", "demo"])
def test_an_unusable_store_fails_in_one_line_before_the_model_loads(
    command: str, cli_env: dict[str, str], tmp_path: Path
) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("not a directory")
    # a model that does not exist: had the model been loaded first, the error would be about it
    env = {**cli_env, "KVSTRATA_MODEL": str(tmp_path / "no-such-model")}
    for store in (a_file / "x", a_file):
        done = kv(env, command, "--store", str(store), *(["hello"] if command == "chat" else []), ok=False)
        assert done.returncode == 1
        assert done.stderr.strip().splitlines() == [done.stderr.strip()], done.stderr  # one line
        assert "Traceback" not in done.stderr and "no model" not in done.stderr
        assert "store directory" in done.stderr and str(store) in done.stderr


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_a_read_only_store_directory_fails_in_one_line(cli_env: dict[str, str], tmp_path: Path) -> None:
    read_only = tmp_path / "ro"
    read_only.mkdir()
    read_only.chmod(0o555)
    try:
        done = kv(
            {**cli_env, "KVSTRATA_MODEL": str(tmp_path / "none")},
            "chat",
            "--store",
            str(read_only),
            "x",
            ok=False,
        )
    finally:
        read_only.chmod(0o755)
    assert done.returncode == 1 and len(done.stderr.strip().splitlines()) == 1
    assert "cannot write to the store directory" in done.stderr


def test_store_demo_is_found_under_its_store_option(tmp_path: Path) -> None:
    args = ["--store", str(tmp_path / "kv")]
    demo = runner.invoke(
        app, ["store", "demo", *args, "--agents", "2", "--turns", "1", "--system-tokens", "64"]
    )
    assert demo.exit_code == 0, demo.output
    listed = runner.invoke(app, ["sessions", "list", *args, "--json"])
    assert listed.exit_code == 0, listed.output
    assert sorted(s["id"] for s in json.loads(listed.output)) == ["agent-0", "agent-1"]


def test_the_progress_bar_is_one_helper_and_stays_off_the_pipe() -> None:
    from kvstrata.bench.common import command
    from kvstrata.cli import eval_cmd, progress

    assert command.progress_bar is progress.progress_bar
    assert eval_cmd.progress_bar is progress.progress_bar
    # under pytest stderr is captured, not a terminal: the bar draws nothing, even when asked to
    assert progress_bar(True).disable and not progress.show_progress(False)


def test_a_fork_continues_its_parents_conversation(cli_env: dict[str, str], tmp_path: Path) -> None:
    """Issue 31, gap 7: the transcript belongs to the session, so `sessions fork` carries it."""
    store = str(tmp_path / "kv")

    def chat(session: str, text: str) -> dict[str, int]:
        args = ["chat", "--store", store, "--session", session, "--max-new-tokens", "4", "--json", text]
        return json.loads(kv(cli_env, *args).stdout)  # type: ignore[no-any-return]

    chat("a", "Day one: we planted beans.")
    second = chat("a", "Day two: we watered them.")
    kv(cli_env, "sessions", "fork", "a", "b", "--store", store)
    alone = chat("c", "And day three?")  # the same message with no history
    forked = chat("b", "And day three?")
    # b's prompt is a's two turns plus the new one, and a's KV is reused for them
    assert forked["prompt_tokens"] > second["prompt_tokens"] + alone["prompt_tokens"] // 2
    assert forked["cached_tokens"] >= second["prompt_tokens"]
    assert not list(Path(store).rglob("chats"))  # nothing of the conversation beside the store


def test_a_transcript_kept_beside_the_store_moves_into_it(cli_env: dict[str, str], tmp_path: Path) -> None:
    store = tmp_path / "kv"
    first = json.loads(kv(cli_env, "chat", "--store", str(store), "-s", "old", "--json", "Hi").stdout)
    (layout_dir,) = [p.parent for p in store.glob("*/index.sqlite")]
    legacy = layout_dir / "chats" / "default" / "old.json"  # where an older build kept it
    legacy.parent.mkdir(parents=True)
    messages = [
        {"role": "user", "content": "Remember the word aubergine."},
        {"role": "assistant", "content": "OK"},
    ]
    legacy.write_text(json.dumps(messages))
    with KVStore(layout_dir, read_only=True) as reader:  # drop the transcript the first chat stored
        assert reader.documents.get("old", "chat") is not None

    with sqlite3.connect(layout_dir / "index.sqlite") as db:
        db.execute("DELETE FROM session_documents")
    again = json.loads(
        kv(cli_env, "chat", "--store", str(store), "-s", "old", "--json", "Which word?").stdout
    )
    assert again["prompt_tokens"] > first["prompt_tokens"]  # the legacy history was sent
    assert not legacy.exists() and not (layout_dir / "chats").exists()
    with KVStore(layout_dir, read_only=True) as reader:
        stored = json.loads(reader.documents.get("old", "chat") or b"[]")
    assert stored[:2] == messages and stored[2]["content"] == "Which word?"
