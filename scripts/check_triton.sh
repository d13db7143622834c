#!/usr/bin/env bash
# The Triton tests under the newest Triton on the registry, beside the one the main venv holds (the
# one torch pins): the kernels must work on both (Triton 3.9's interpreter refused a mask 3.8 took).
#
#   scripts/check_triton.sh [MAIN_VENV]      # default .venv; the second venv is a temporary one, removed after
#
# The second venv holds Triton alone and reads everything else from the main venv (a .pth file that
# adds the main venv's site-packages after its own), so the check downloads one wheel, not torch.
set -euo pipefail
cd "$(dirname "$0")/.."
main=${1:-.venv}
venv=$(mktemp -d "${TMPDIR:-/tmp}/fastcifar-triton-XXXXXX")
trap 'rm -rf "$venv"' EXIT
site_of() { "$1/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }
"$main/bin/python" -m venv "$venv"
echo "import site; site.addsitedir('$(site_of "$main")')" > "$(site_of "$venv")/zz_fastcifar_main_venv.pth"
"$venv/bin/pip" install -q --no-deps --upgrade triton  # the newest one pip may take
echo "the Triton tests under the newest Triton, beside the main venv's other packages (pytest's header: the versions)"
# every kernel test but the slow compiles and the two whole-network trainings (35 s each on a shared 2-core
# machine; the per-kernel tests cover the same kernels), to keep CI's extra time near 3 minutes
"$venv/bin/python" -m pytest -p no:cacheprovider -m "not slow" \
    -k "not test_resnet9_trains_like_torch_path and not test_fused_default_preset_steps_like_the_unfused_one" \
    tests/kernels tests/unit/test_augment.py tests/unit/test_loader.py tests/harness/test_versions.py
