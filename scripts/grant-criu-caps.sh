#!/usr/bin/env bash
# Lets the members of one group checkpoint and restore their own kernels without root:
# installs a copy of criu (and of cedana-pidbase) that only that group can run, carrying
# the file capabilities CRIU's --unprivileged mode needs. Idempotent; run as root.
#
#   scripts/grant-criu-caps.sh [--group cedana] [--dest /usr/local/lib/cedana]
#                              [--criu /usr/local/sbin/criu] [--pidbase PATH] [--add-user U]...
#
# Capabilities of DEST/criu (cap_checkpoint_restore,cap_sys_ptrace,cap_net_admin,
# cap_setpcap+eip):
#   cap_checkpoint_restore  choose the PIDs of restored tasks, read /proc/PID/map_files
#   cap_sys_ptrace          seize the kernel's tasks and inject CRIU's parasite code
#   cap_net_admin           TCP repair mode for the kernel's ZMQ sockets (restore fails
#                           without it)
#   cap_setpcap             restore the tasks' own capability sets ("Unable to drop
#                           capability 24" without it)
# CRIU itself refuses to dump or restore a process whose uids or gids differ from those
# of the user who runs it, so a member can checkpoint only their own processes; but
# ptrace of any process is a root-equivalent power should CRIU have a bug: give the group
# only to the users who run Jupyter servers (docs/deployment.md, "Security model").
#
# DEST/cedana-pidbase carries cap_checkpoint_restore+ep, used only to raise
# /proc/sys/kernel/ns_last_pid before a kernel starts (see native/cedana-pidbase.c).
#
# Note: setcap must come after chown/chmod: changing a file's owner clears its file
# capabilities without a word.
set -euo pipefail
cd "$(dirname "$0")/.."

GROUP=cedana
DEST=/usr/local/lib/cedana
CRIU=${CRIU:-/usr/local/sbin/criu}
PIDBASE=jupyter_cedana/bin/cedana-pidbase
USERS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --group) GROUP=$2; shift 2 ;;
    --dest) DEST=$2; shift 2 ;;
    --criu) CRIU=$2; shift 2 ;;
    --pidbase) PIDBASE=$2; shift 2 ;;
    --add-user) USERS+=("$2"); shift 2 ;;
    *) echo "usage: $0 [--group G] [--dest DIR] [--criu PATH] [--pidbase PATH] [--add-user U]..." >&2
       exit 2 ;;
  esac
done

say() { printf '[grant-criu-caps] %s\n' "$*"; }
fail() { printf '[grant-criu-caps] FAILED: %s\n' "$*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || fail "needs root (groupadd, setcap)"
command -v setcap >/dev/null || fail "setcap missing (apt-get install libcap2-bin)"
[ -x "$CRIU" ] || fail "no criu at $CRIU (scripts/install-criu.sh)"
[ -x "$PIDBASE" ] || fail "no cedana-pidbase at $PIDBASE (build native/: make -C native)"

getent group "$GROUP" >/dev/null || { say "creating group $GROUP"; groupadd --system "$GROUP"; }
for u in "${USERS[@]}"; do
  id -nG "$u" | tr ' ' '\n' | grep -qx "$GROUP" || { say "adding $u to $GROUP"; usermod -aG "$GROUP" "$u"; }
done

# The directory too: nobody outside the group can even see what it holds.
install -d -o root -g "$GROUP" -m 0750 "$DEST"

grant() {  # SRC NAME CAPS
  local src=$1 dst=$DEST/$2 caps=$3
  if ! cmp -s "$src" "$dst" 2>/dev/null; then
    # Into place by rename: a criu running from the old copy keeps its inode.
    install -o root -g "$GROUP" -m 0750 "$src" "$dst.new"
    mv -f "$dst.new" "$dst"
  fi
  chown root:"$GROUP" "$dst"
  chmod 0750 "$dst"
  setcap "$caps" "$dst"  # after chown: chown clears file capabilities
  getcap "$dst" | grep -q cap_checkpoint_restore || fail "setcap on $dst did not hold (filesystem without xattrs?)"
  say "$dst: $(getcap "$dst" | cut -d' ' -f2-) (root:$GROUP 0750)"
}
grant "$CRIU" criu cap_checkpoint_restore,cap_sys_ptrace,cap_net_admin,cap_setpcap+eip
grant "$PIDBASE" cedana-pidbase cap_checkpoint_restore+ep
