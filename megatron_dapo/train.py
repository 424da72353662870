"""Entry point: `python -m megatron_dapo.train --config configs/<recipe>.yaml [key=value ...]`.

`--print-config` prints the resolved YAML and exits 0. An invalid config exits with code 2 and one
line naming the key and what was expected.
"""

from __future__ import annotations

import argparse
import sys

from megatron_dapo.config import ConfigError, load_config, to_yaml


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m megatron_dapo.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None, help="YAML recipe of overrides (configs/*.yaml)")
    p.add_argument("--print-config", action="store_true", help="print the resolved config as YAML and exit")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. actor.lr=1e-5")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        sys.stdout.write(to_yaml(cfg))
        return 0
    from megatron_dapo.trainer.run import run

    return run(cfg)


if __name__ == "__main__":
    sys.exit(main())
