#!/usr/bin/env bash
# What a call of the lent GPU machine sends, kept under its 64 MiB: the tracked and
# untracked-not-ignored files plus the paths the call carries. The shipped heads
# (python/specrs/heads/<target>/, ~69 MB of bf16 weights, barely compressible) are tracked and alone
# pass that limit, and the CUDA wheel (`make wheel-cuda`) holds them again; a GPU check
# (scripts/gpu_bench.py, scripts/gpu_check.py) loads neither.
#
#   scripts/device-tree.sh hide     take the heads' folders out of the index (the files stay on
#                                   disk, ignored through .git/info/exclude) and write the CUDA
#                                   wheel without them to .device/ (ignored: carry ".device" in
#                                   the call)
#   scripts/device-tree.sh size     the bytes the call would send (without what it carries beyond
#                                   .device)
#   scripts/device-tree.sh restore  put the heads back in the index
#
# Run `restore` right after the device call: while hidden, the heads read as deleted in the index,
# so a commit made then would delete them.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
heads=(python/specrs/heads/*/)
exclude="$(git rev-parse --git-path info/exclude)"
mark="# device-tree.sh hide"

case "${1:-}" in
hide)
    mkdir -p "$(dirname "$exclude")" .device
    grep -qxF "$mark" "$exclude" 2>/dev/null || {
        echo "$mark"
        for folder in "${heads[@]}"; do echo "/$folder"; done
    } >>"$exclude"
    git rm -r -q --cached --ignore-unmatch "${heads[@]}"
    wheels=(dist-cuda/specrs-*.whl)
    [ -f "${wheels[0]}" ] || { echo "no CUDA wheel in dist-cuda/: run make wheel-cuda first" >&2; exit 1; }
    rm -f .device/specrs-*.whl
    cp "${wheels[0]}" .device/
    slim=".device/$(basename "${wheels[0]}")"
    # The heads' files and their RECORD lines (pip installs what RECORD names).
    zip -q -d "$slim" 'specrs/heads/*/*'
    record="$(unzip -Z1 "$slim" | grep '\.dist-info/RECORD$')"
    tmp="$(mktemp -d)"
    unzip -q -d "$tmp" "$slim" "$record"
    grep -v '^specrs/heads/[^/]*/' "$tmp/$record" >"$tmp/RECORD.slim" && mv "$tmp/RECORD.slim" "$tmp/$record"
    (cd "$tmp" && zip -q "$OLDPWD/$slim" "$record")
    rm -rf "$tmp"
    "$0" size
    ;;
size)
    {
        git ls-files -z --cached --others --exclude-standard
        [ -d .device ] && find .device -type f -print0
    } | xargs -0 du -cb 2>/dev/null | tail -1 | awk '{printf "%.1f MiB would travel (limit 64 MiB)\n", $1 / 1048576}'
    ;;
restore)
    git reset -q -- "${heads[@]}"
    if [ -f "$exclude" ]; then
        grep -vxF -e "$mark" $(printf -- '-e /%s ' "${heads[@]}") "$exclude" >"$exclude.tmp" || true
        mv "$exclude.tmp" "$exclude"
    fi
    git status --short -- python/specrs/heads
    ;;
*)
    sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
    ;;
esac
