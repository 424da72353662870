"""Entry point: `python -m megatron_dapo.train --config configs/<recipe>.yaml [key=value ...]`.

`--print-config` prints the resolved YAML and exits 0; `--check` runs the preflight (megatron_dapo/preflight.py)
and exits 2 with one line per problem, or 0. An invalid config exits with code 2 and one line naming the key
and what was expected.
"""

from __future__ import annotations

import argparse
import sys

from megatron_dapo.config import load_config_cli, to_yaml


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m megatron_dapo.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None, help="YAML recipe of overrides (configs/*.yaml)")
    p.add_argument("--print-config", action="store_true", help="print the resolved config as YAML and exit")
    p.add_argument("--check", action="store_true",
                   help="the preflight: tokenizer, data files, model against the layout, reward, output directories "
                        "and the memory plan; one line per problem and exit 2, or one 'ok' line (exit 0)")
    p.add_argument("--gpu-memory-gb", type=float, default=80.0, help="GPU memory the --check plan uses (GiB)")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. actor.lr=1e-5")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from megatron_dapo.trainer.run import quiet_libraries

    quiet_libraries()  # before anything imports Megatron-Core, whose fallback notices come at import
    args = parse_args(argv)
    cfg = load_config_cli(args.config, args.overrides)
    if cfg is None:
        return 2
    if args.print_config:
        sys.stdout.write(to_yaml(cfg))
        return 0
    if args.check:
        from megatron_dapo.preflight import main as preflight

        return preflight(cfg, gpu_memory_gib=args.gpu_memory_gb)
    from megatron_dapo.trainer.run import run

    return run(cfg)


if __name__ == "__main__":
    code = main()
    from megatron_dapo.trainer.run import exit_process

    exit_process(code)  # the atexit handlers run; the interpreter's teardown (~1 s of CPU per rank) does not
