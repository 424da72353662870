#!/usr/bin/env bash
# Print the first Python >= 3.11 on PATH, preferring 3.11 (the CPU torch wheel these machines keep is for
# 3.11): python3.11, python3.12, python3.13, python3.14, then python3. Exit 2 naming what was found when
# none is new enough. `make install` uses it unless PY is given.
set -uo pipefail
found=()
for name in python3.11 python3.12 python3.13 python3.14 python3; do
    path=$(command -v "$name" 2>/dev/null) || continue
    version=$("$path" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null) || continue
    found+=("$name ($version)")
    if [[ "$version" =~ ^3\.([0-9]+)$ ]] && (( BASH_REMATCH[1] >= 11 )); then
        echo "$path"
        exit 0
    fi
done
echo "need Python 3.11 or newer on PATH (found: ${found[*]:-none}); pass one with PY=/path/to/python3.11" >&2
exit 2
