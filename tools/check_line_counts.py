"""Guard rail (STYLE.md, avoid #8): no Python module outside kernels/ above 1000 lines."""

import pathlib
import sys

LIMIT = 1000
root = pathlib.Path(__file__).resolve().parent.parent
too_long = []
for path in sorted((root / "megatron_dapo").rglob("*.py")):
    if "kernels" in path.relative_to(root).parts:
        continue
    n = sum(1 for _ in path.open())
    if n > LIMIT:
        too_long.append(f"{path.relative_to(root)}: {n} lines (limit {LIMIT})")
if too_long:
    print("\n".join(too_long))
    sys.exit(1)
print(f"line counts ok (limit {LIMIT} outside kernels/)")
