# Shared by the guest build scripts (build-guest.sh, build-rootfs.sh,
# build-esp.sh) and setup.sh, which source it: where things are, the log
# line, Debian package checks, and publishing a cached file.
#
# Sourced, never run: it defines variables and functions and does nothing
# else. It must stay free of the functions whose text keys a cache
# (build_kernel, build_initramfs, build_rootfs): those hash their own body
# from "$0", the script that holds them.
#
#   here    resources/            top     the repository
#   cache   ${TANDEM_CACHE:-~/.cache/tandem}, where built guest files live
#   out     target/guest, where they are linked for use

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
top=$(cd "$here/.." && pwd)
cache=${TANDEM_CACHE:-$HOME/.cache/tandem}
out="$top/target/guest"
# The log prefix: the running script's name (build-guest, setup, ...).
log_name=$(basename "$0" .sh)

log() { printf '%s: %s\n' "$log_name" "$*" >&2; }

# Installs those of the Debian packages given that are not installed yet.
install_deps() {
    local missing=() p
    for p in "$@"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'ok installed' || missing+=("$p")
    done
    if [ ${#missing[@]} -gt 0 ]; then
        log "installing ${missing[*]}"
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq
        apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    fi
}

# The installed version of a Debian package (part of the cache keys).
pkgver() { dpkg-query -W -f='${Version}' "$1"; }

# Links (or copies, across file systems) a cached file into target/guest.
publish() {
    mkdir -p "$out"
    ln -f "$1" "$out/$2" 2>/dev/null || cp -f "$1" "$out/$2"
}
