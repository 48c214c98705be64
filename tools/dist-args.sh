# shellcheck shell=bash
# The command line python/dist.sh and node/dist.sh share (sourced by them, not run):
#   [--profile release|dev] [--out DIR]
# Sets `profile` (release by default) and `out` (DIST_DEFAULT_OUT unless given); `DIST_NAME`
# names the script in errors. Exits 2 on anything else.
profile=release
out=$DIST_DEFAULT_OUT
while (($#)); do
    case $1 in
    --profile) profile=${2:?--profile needs release or dev}; shift 2 ;;
    --out) out=${2:?--out needs a directory}; shift 2 ;;
    *) echo "$DIST_NAME: unknown argument '$1' (expected --profile release|dev, --out DIR)" >&2; exit 2 ;;
    esac
done
case $profile in
release | dev) ;;
*) echo "$DIST_NAME: --profile '$profile': expected release or dev" >&2; exit 2 ;;
esac
