/* common/ipc.h: the folder of a ZeroMQ ipc:// socket, kept private, and socket files left behind
 * by processes that are gone.
 *
 * A unix socket's own mode bits are not a safe guard (umask, and libzmq creates it with the
 * process's), so the router's ipc socket lives in a folder that only its user can enter: mode
 * 0700, owned by that user. mt_wire_open binds a ROUTER's ipc:// endpoint only in such a folder
 * (common/wire.h), and metrale-serve keeps its sockets in one (/tmp/metrale-<uid>).
 *
 * A socket file is stale when connecting to it is refused (nobody listens: its process died
 * without removing it). libzmq would silently replace any file at a bound path, a live router's
 * included; these functions remove stale ones only and say when a path is in use.
 *
 * Pure functions over the file system; any thread.
 */
#ifndef MT_IPC_H
#define MT_IPC_H

#include "common/mt.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Makes dir (one level) with mode 0700 when it is missing; then checks that it is a folder owned
 * by this process's user with no group or other permission. MT_ERR_INVALID names what is wrong
 * (a folder of another user, or one others may enter); MT_ERR_IO when it cannot be made. */
mt_status mt_ipc_dir_private(const char *dir, mt_error *err);

/* Prepares path for a bind: nothing there, or a stale socket (removed): MT_OK. A socket that a
 * process listens on: MT_ERR_STATE; anything else there (a file, a folder): MT_ERR_INVALID. */
mt_status mt_ipc_clear_stale(const char *path, mt_error *err);

/* Removes every stale socket file in dir whose name starts with prefix and that is older than
 * 10 s (a socket bound a moment ago may not listen yet); the number removed. */
int mt_ipc_clear_stale_dir(const char *dir, const char *prefix);

#ifdef __cplusplus
}
#endif
#endif /* MT_IPC_H */
