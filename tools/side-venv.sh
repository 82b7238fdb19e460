# Shared by tools/setup-sglang and tools/setup-tokenspeed (sourced, not run):
# builds a struct-only engine venv, one that exists to import an engine's
# message structs for the codec round-trip tests and the launch-time layout
# check. The engines themselves need a GPU and never run from it.
#
#   side_venv VENV SPEC RECIPE IMPORT_CHECK STUBS DEPS...
#
# VENV: where; SPEC: the engine release (installed with --no-deps: its own
# dependency pins are CUDA builds, or forked smg packages); RECIPE: the stamp
# that makes a finished venv a no-op next time (bump it when the recipe
# changes); IMPORT_CHECK: the smoke import; STUBS: comma-separated GPU-only
# packages that import as inert stand-ins (tools/side_venv_stubs.py), each
# NAME or NAME==VERSION (then with package metadata of that version);
# DEPS: the packages the struct modules import. torch is the CPU build,
# pinned by a constraint so no dependency can swap in a CUDA build.
side_venv() {
    local venv="$1" spec="$2" recipe="$3" check="$4" stubs="$5"
    shift 5
    local python="${PYTHON:-python3}" stamp="$venv/.enginelink-side-venv"
    local here
    here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
    if [ -x "$venv/bin/python" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$recipe" ]; then
        return 0
    fi
    echo "setting up $venv for $spec (struct-only, CPU wheels; a few minutes, once)" >&2
    local started=$SECONDS
    [ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
    local pip=("$venv/bin/python" -m pip install --quiet)
    local torch="torch==2.13.0+cpu"
    local constraints="$venv/enginelink-constraints.txt"
    printf '%s\n' "$torch" > "$constraints"
    # The CPU torch lives on the PyTorch wheel index, not PyPI; machines that
    # carry it locally (pip's find-links) need no extra index.
    if ! "${pip[@]}" "$torch"; then
        echo "retrying $torch with the PyTorch CPU wheel index" >&2
        "${pip[@]}" "$torch" --extra-index-url https://download.pytorch.org/whl/cpu
    fi
    "${pip[@]}" -c "$constraints" "$@"
    "${pip[@]}" --no-deps "$spec"
    local site
    site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    cp "$here/side_venv_stubs.py" "$site/_enginelink_side_venv_stubs.py"
    # A stand-in given as NAME==VERSION also gets package metadata, for code
    # that asks importlib.metadata for the version (transformers does for torchvision).
    local names="" entry name version
    for entry in ${stubs//,/ }; do
        name="${entry%%==*}"
        names="$names'$name',"
        if [ "$entry" != "$name" ]; then
            version="${entry#*==}"
            mkdir -p "$site/$name-$version.dist-info"
            printf 'Metadata-Version: 2.1\nName: %s\nVersion: %s\nSummary: import stand-in (enginelink tools/side_venv_stubs.py)\n' \
                "$name" "$version" > "$site/$name-$version.dist-info/METADATA"
            : > "$site/$name-$version.dist-info/RECORD"
        fi
    done
    printf 'import _enginelink_side_venv_stubs as s; s.install((%s))\n' "$names" > "$site/enginelink-side-venv-stubs.pth"
    "$venv/bin/python" -c "$check" >&2
    printf '%s' "$recipe" > "$stamp"
    echo "$venv ready in $((SECONDS - started)) s" >&2
}
