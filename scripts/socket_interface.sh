# Sourced by the multi-node launch scripts with the first node's host name or address:
#   . scripts/socket_interface.sh "$HEAD"
# Puts NCCL's and gloo's sockets on the same network interface: the one this node reaches the first node through
# (on the first node itself, the one holding its address), so that neither follows a host name that resolves to a
# loopback address or to another NIC. gloo carries the checkpoint manager's collectives on every multi-node run.
# SOCKET_IFNAME chooses the interface for both; NCCL_SOCKET_IFNAME or GLOO_SOCKET_IFNAME, when set, are kept.
_head=$(getent ahostsv4 "$1" 2>/dev/null | awk '{print $1; exit}')
_head=${_head:-$1}
_interface=${SOCKET_IFNAME:-}
if [ -z "$_interface" ]; then
    _interface=$(ip -o route get "$_head" 2>/dev/null | sed -n 's/.* dev \([^ ]*\).*/\1/p')
    if [ -z "$_interface" ] || [ "$_interface" = lo ]; then
        _interface=$(ip -o addr show to "$_head" 2>/dev/null | awk '{print $2; exit}')
    fi
fi
if [ -n "$_interface" ]; then
    export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-$_interface}
    export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-$NCCL_SOCKET_IFNAME}
else
    echo "warning: no network interface found towards $1; NCCL and gloo pick their own (set SOCKET_IFNAME)" >&2
fi
unset _head _interface
