#!/usr/bin/env bash
# Makes a private CA and one host certificate it signs, for tandem's
# migration and COLO streams (tandem run --tls-cert/--tls-key/--tls-ca),
# with the openssl CLI:
#
#   resources/tls-certs.sh DIR [--ca-from DIR2] ADDR...
#
# DIR gets ca.pem (give it to every host as --tls-ca), host.pem and
# host.key (--tls-cert, --tls-key). The certificate names each ADDR (an IP
# address, or a DNS name) the peers dial this host by, and serves both as
# server and client. A second host's certificate: run it again with
# --ca-from DIR (the first host's directory: its CA signs it); without it a
# new CA is made. Keys are P-256, valid 30 days. Keep ca.key off the hosts.
set -euo pipefail
if [ $# -lt 2 ]; then
    sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
fi
dir=$1
shift
ca_from=
if [ "${1:-}" = "--ca-from" ]; then
    ca_from=$2
    shift 2
fi
[ $# -ge 1 ] || { echo "tls-certs.sh: no address to name" >&2; exit 2; }
mkdir -p "$dir"
cd "$dir"
if [ -n "$ca_from" ]; then
    cp "$ca_from/ca.pem" ca.pem
    cp "$ca_from/ca.key" ca.key
else
    openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
        -keyout ca.key -out ca.pem -days 30 -subj "/CN=tandem-ca-$(hostname)-$$" \
        -addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign \
        2>/dev/null
fi
san=
for a in "$@"; do
    if [[ $a =~ ^[0-9.]+$ || $a == *:* ]]; then
        san+="${san:+,}IP:$a"
    else
        san+="${san:+,}DNS:$a"
    fi
done
openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
    -keyout host.key -out host.csr -subj "/CN=$1" 2>/dev/null
printf '%s\n' "subjectAltName=$san" "basicConstraints=critical,CA:FALSE" \
    "keyUsage=critical,digitalSignature" "extendedKeyUsage=serverAuth,clientAuth" >host.ext
openssl x509 -req -in host.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 30 \
    -extfile host.ext -out host.pem 2>/dev/null
rm -f host.csr host.ext ca.srl
chmod 600 host.key ca.key
echo "tls-certs.sh: $dir: ca.pem, host.pem, host.key (names: $san)"
