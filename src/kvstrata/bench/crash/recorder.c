/* The file operations a process makes under one directory, recorded for crash-state replay.

   Loaded with LD_PRELOAD, it wraps the C library's file calls (open, write and its positioned
   and vector forms, truncate, fallocate, fsync, fdatasync, rename, unlink, mkdir, rmdir, close):
   every call that succeeds on a path under $KVS_TRACE_ROOT (or on a descriptor opened there) is
   appended to $KVS_TRACE_LOG as one record, the bytes written included, in the order the calls
   returned (a mutex orders the records; an fsync is recorded when it starts and when it returns,
   so a write that returned before an fsync started is known to be covered by it). Writes to the
   file named $KVS_TRACE_MARK are recorded as markers: the workload says there what it has done.
   SQLite's own I/O, native code and O_DIRECT writes all go through these calls, so they are all
   seen; calls that would copy or link files (sendfile, copy_file_range, link) are recorded as
   unsupported, so a replay refuses to guess.

   Record: u32 length of the rest, u8 op, u32 pid, i64 a, i64 b, i64 c, u16 path length,
   u16 second path length, the paths, then the data. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <unistd.h>

enum {
    OP_OPEN = 1, OP_CLOSE, OP_WRITE, OP_TRUNC, OP_FSYNC_BEGIN, OP_FSYNC_END, OP_RENAME, OP_UNLINK,
    OP_MKDIR, OP_RMDIR, OP_MARK, OP_UNSUPPORTED, OP_FALLOCATE, OP_SYNC_ALL_BEGIN, OP_SYNC_ALL_END
};
#define MAX_FD 65536
#define TRACKED 1
#define MARKER 2

static int log_fd = -1;
static char root[PATH_MAX];
static size_t root_len;
static char mark_path[PATH_MAX];
static unsigned char tracked[MAX_FD];
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;

#define REAL(name) static __typeof__(&name) real_##name; if (!real_##name) real_##name = dlsym(RTLD_NEXT, #name)

static void raw_write_all(const void *buf, size_t n) {
    const char *p = buf;
    while (n > 0) {
        long w = syscall(SYS_write, log_fd, p, n);
        if (w <= 0) { if (w < 0 && errno == EINTR) continue; return; }
        p += w; n -= (size_t)w;
    }
}

static void emit(int op, int64_t a, int64_t b, int64_t c, const char *p1, const char *p2,
                 const struct iovec *iov, int iovcnt, size_t data_len) {
    uint16_t l1 = p1 ? (uint16_t)strlen(p1) : 0, l2 = p2 ? (uint16_t)strlen(p2) : 0;
    unsigned char head[4 + 1 + 4 + 24 + 4];
    uint32_t rest = 1 + 4 + 24 + 4 + l1 + l2 + (uint32_t)data_len;
    uint32_t pid = (uint32_t)getpid();
    memcpy(head, &rest, 4);
    head[4] = (unsigned char)op;
    memcpy(head + 5, &pid, 4);
    memcpy(head + 9, &a, 8);
    memcpy(head + 17, &b, 8);
    memcpy(head + 25, &c, 8);
    memcpy(head + 33, &l1, 2);
    memcpy(head + 35, &l2, 2);
    int saved = errno;
    pthread_mutex_lock(&mu);
    raw_write_all(head, sizeof head);
    if (l1) raw_write_all(p1, l1);
    if (l2) raw_write_all(p2, l2);
    size_t left = data_len;
    for (int i = 0; i < iovcnt && left > 0; i++) {
        size_t n = iov[i].iov_len < left ? iov[i].iov_len : left;
        raw_write_all(iov[i].iov_base, n);
        left -= n;
    }
    pthread_mutex_unlock(&mu);
    errno = saved;
}

__attribute__((constructor)) static void setup(void) {
    const char *log = getenv("KVS_TRACE_LOG"), *r = getenv("KVS_TRACE_ROOT"), *m = getenv("KVS_TRACE_MARK");
    if (!log || !r) return;
    strncpy(root, r, sizeof root - 1);
    root_len = strlen(root);
    while (root_len > 1 && root[root_len - 1] == '/') root[--root_len] = 0;
    if (m) strncpy(mark_path, m, sizeof mark_path - 1);
    log_fd = (int)syscall(SYS_openat, AT_FDCWD, log, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
}

/* The absolute form of ``path`` (relative to ``dirfd``), without symbolic links resolved. */
static int absolute(int dirfd, const char *path, char *out) {
    if (!path) return 0;
    if (path[0] == '/') {
        strncpy(out, path, PATH_MAX - 1);
        out[PATH_MAX - 1] = 0;
        return 1;
    }
    char base[PATH_MAX / 2];
    if (dirfd == AT_FDCWD) {
        if (!getcwd(base, sizeof base)) return 0;
    } else {
        char link[64];
        snprintf(link, sizeof link, "/proc/self/fd/%d", dirfd);
        ssize_t n = readlink(link, base, sizeof base - 1);
        if (n < 0) return 0;
        base[n] = 0;
    }
    snprintf(out, PATH_MAX, "%s/%s", base, path);
    return 1;
}

static int under_root(const char *abs) {
    return log_fd >= 0 && strncmp(abs, root, root_len) == 0 && (abs[root_len] == '/' || abs[root_len] == 0);
}

static void opened(int fd, int dirfd, const char *path, int flags) {
    char abs[PATH_MAX];
    if (fd < 0 || fd >= MAX_FD || log_fd < 0 || !absolute(dirfd, path, abs)) return;
    if (mark_path[0] && strcmp(abs, mark_path) == 0) { tracked[fd] = MARKER; return; }
    if (!under_root(abs)) { tracked[fd] = 0; return; }
    tracked[fd] = TRACKED;
    emit(OP_OPEN, fd, flags, 0, abs, NULL, NULL, 0, 0);
}

static int is_tracked(int fd) { return fd >= 0 && fd < MAX_FD && tracked[fd]; }

static void wrote(int fd, int64_t offset, const struct iovec *iov, int cnt, ssize_t n) {
    if (n <= 0 || !is_tracked(fd)) return;
    if (tracked[fd] == MARKER) { emit(OP_MARK, 0, 0, 0, NULL, NULL, iov, cnt, (size_t)n); return; }
    if (offset < 0) offset = (int64_t)lseek(fd, 0, SEEK_CUR) - n;  /* after the write: where it went */
    emit(OP_WRITE, fd, offset, n, NULL, NULL, iov, cnt, (size_t)n);
}

#define OPEN_BODY(realname, dirfd)                                                   \
    mode_t mode = 0;                                                                 \
    if (flags & (O_CREAT | O_TMPFILE)) { va_list ap; va_start(ap, flags); mode = va_arg(ap, int); va_end(ap); } \
    REAL(realname);

int open(const char *path, int flags, ...) { OPEN_BODY(open, AT_FDCWD) int fd = real_open(path, flags, mode); opened(fd, AT_FDCWD, path, flags); return fd; }
int open64(const char *path, int flags, ...) { OPEN_BODY(open64, AT_FDCWD) int fd = real_open64(path, flags, mode); opened(fd, AT_FDCWD, path, flags); return fd; }
int openat(int dirfd, const char *path, int flags, ...) { OPEN_BODY(openat, dirfd) int fd = real_openat(dirfd, path, flags, mode); opened(fd, dirfd, path, flags); return fd; }
int openat64(int dirfd, const char *path, int flags, ...) { OPEN_BODY(openat64, dirfd) int fd = real_openat64(dirfd, path, flags, mode); opened(fd, dirfd, path, flags); return fd; }
int __open_2(const char *path, int flags) { REAL(__open_2); int fd = real___open_2(path, flags); opened(fd, AT_FDCWD, path, flags); return fd; }
int __open64_2(const char *path, int flags) { REAL(__open64_2); int fd = real___open64_2(path, flags); opened(fd, AT_FDCWD, path, flags); return fd; }
int __openat_2(int dirfd, const char *path, int flags) { REAL(__openat_2); int fd = real___openat_2(dirfd, path, flags); opened(fd, dirfd, path, flags); return fd; }
int creat(const char *path, mode_t mode) { REAL(creat); int fd = real_creat(path, mode); opened(fd, AT_FDCWD, path, O_CREAT | O_WRONLY | O_TRUNC); return fd; }
int creat64(const char *path, mode_t mode) { REAL(creat64); int fd = real_creat64(path, mode); opened(fd, AT_FDCWD, path, O_CREAT | O_WRONLY | O_TRUNC); return fd; }

int close(int fd) {
    REAL(close);
    int tracked_now = is_tracked(fd) && tracked[fd] == TRACKED;
    int r = real_close(fd);
    if (r == 0 && fd >= 0 && fd < MAX_FD) {
        if (tracked_now) emit(OP_CLOSE, fd, 0, 0, NULL, NULL, NULL, 0, 0);
        tracked[fd] = 0;
    }
    return r;
}

ssize_t write(int fd, const void *buf, size_t n) {
    REAL(write);
    ssize_t r = real_write(fd, buf, n);
    struct iovec iov = {(void *)buf, n};
    wrote(fd, -1, &iov, 1, r);
    return r;
}
ssize_t writev(int fd, const struct iovec *iov, int cnt) { REAL(writev); ssize_t r = real_writev(fd, iov, cnt); wrote(fd, -1, iov, cnt, r); return r; }
ssize_t pwrite(int fd, const void *buf, size_t n, off_t off) { REAL(pwrite); ssize_t r = real_pwrite(fd, buf, n, off); struct iovec iov = {(void *)buf, n}; wrote(fd, off, &iov, 1, r); return r; }
ssize_t pwrite64(int fd, const void *buf, size_t n, off_t off) { REAL(pwrite64); ssize_t r = real_pwrite64(fd, buf, n, off); struct iovec iov = {(void *)buf, n}; wrote(fd, off, &iov, 1, r); return r; }
ssize_t pwritev(int fd, const struct iovec *iov, int cnt, off_t off) { REAL(pwritev); ssize_t r = real_pwritev(fd, iov, cnt, off); wrote(fd, off, iov, cnt, r); return r; }
ssize_t pwritev64(int fd, const struct iovec *iov, int cnt, off_t off) { REAL(pwritev64); ssize_t r = real_pwritev64(fd, iov, cnt, off); wrote(fd, off, iov, cnt, r); return r; }
ssize_t pwritev2(int fd, const struct iovec *iov, int cnt, off_t off, int flags) { REAL(pwritev2); ssize_t r = real_pwritev2(fd, iov, cnt, off, flags); wrote(fd, off, iov, cnt, r); return r; }
ssize_t pwritev64v2(int fd, const struct iovec *iov, int cnt, off_t off, int flags) { REAL(pwritev64v2); ssize_t r = real_pwritev64v2(fd, iov, cnt, off, flags); wrote(fd, off, iov, cnt, r); return r; }

static void truncated(int fd, const char *path, off_t len) {
    char abs[PATH_MAX];
    if (path) { if (absolute(AT_FDCWD, path, abs) && under_root(abs)) emit(OP_TRUNC, -1, len, 0, abs, NULL, NULL, 0, 0); }
    else if (is_tracked(fd) && tracked[fd] == TRACKED) emit(OP_TRUNC, fd, len, 0, NULL, NULL, NULL, 0, 0);
}
int ftruncate(int fd, off_t len) { REAL(ftruncate); int r = real_ftruncate(fd, len); if (r == 0) truncated(fd, NULL, len); return r; }
int ftruncate64(int fd, off_t len) { REAL(ftruncate64); int r = real_ftruncate64(fd, len); if (r == 0) truncated(fd, NULL, len); return r; }
int truncate(const char *path, off_t len) { REAL(truncate); int r = real_truncate(path, len); if (r == 0) truncated(-1, path, len); return r; }
int truncate64(const char *path, off_t len) { REAL(truncate64); int r = real_truncate64(path, len); if (r == 0) truncated(-1, path, len); return r; }

static void allocated(int fd, off_t off, off_t len) {
    if (is_tracked(fd) && tracked[fd] == TRACKED) emit(OP_FALLOCATE, fd, off, len, NULL, NULL, NULL, 0, 0);
}
int fallocate(int fd, int mode, off_t off, off_t len) { REAL(fallocate); int r = real_fallocate(fd, mode, off, len); if (r == 0 && !(mode & 1)) allocated(fd, off, len); return r; }
int fallocate64(int fd, int mode, off_t off, off_t len) { REAL(fallocate64); int r = real_fallocate64(fd, mode, off, len); if (r == 0 && !(mode & 1)) allocated(fd, off, len); return r; }
int posix_fallocate(int fd, off_t off, off_t len) { REAL(posix_fallocate); int r = real_posix_fallocate(fd, off, len); if (r == 0) allocated(fd, off, len); return r; }
int posix_fallocate64(int fd, off_t off, off_t len) { REAL(posix_fallocate64); int r = real_posix_fallocate64(fd, off, len); if (r == 0) allocated(fd, off, len); return r; }

#define SYNC_WRAP(name)                                                                  \
    int name(int fd) {                                                                   \
        REAL(name);                                                                      \
        int t = is_tracked(fd) && tracked[fd] == TRACKED;                                \
        if (t) emit(OP_FSYNC_BEGIN, fd, 0, 0, NULL, NULL, NULL, 0, 0);                  \
        int r = real_##name(fd);                                                         \
        if (t && r == 0) emit(OP_FSYNC_END, fd, 0, 0, NULL, NULL, NULL, 0, 0);          \
        return r;                                                                        \
    }
SYNC_WRAP(fsync)
SYNC_WRAP(fdatasync)
int syncfs(int fd) { REAL(syncfs); emit(OP_SYNC_ALL_BEGIN, 0, 0, 0, NULL, NULL, NULL, 0, 0); int r = real_syncfs(fd); if (r == 0) emit(OP_SYNC_ALL_END, 0, 0, 0, NULL, NULL, NULL, 0, 0); return r; }
void sync(void) { REAL(sync); emit(OP_SYNC_ALL_BEGIN, 0, 0, 0, NULL, NULL, NULL, 0, 0); real_sync(); emit(OP_SYNC_ALL_END, 0, 0, 0, NULL, NULL, NULL, 0, 0); }

static void renamed(int d1, const char *p1, int d2, const char *p2, unsigned flags) {
    char a1[PATH_MAX], a2[PATH_MAX];
    if (!absolute(d1, p1, a1) || !absolute(d2, p2, a2)) return;
    if (under_root(a1) || under_root(a2)) emit(OP_RENAME, flags, 0, 0, a1, a2, NULL, 0, 0);
}
int rename(const char *a, const char *b) { REAL(rename); int r = real_rename(a, b); if (r == 0) renamed(AT_FDCWD, a, AT_FDCWD, b, 0); return r; }
int renameat(int da, const char *a, int db, const char *b) { REAL(renameat); int r = real_renameat(da, a, db, b); if (r == 0) renamed(da, a, db, b, 0); return r; }
int renameat2(int da, const char *a, int db, const char *b, unsigned flags) { REAL(renameat2); int r = real_renameat2(da, a, db, b, flags); if (r == 0) renamed(da, a, db, b, flags); return r; }

static void path_op(int op, int dirfd, const char *path) {
    char abs[PATH_MAX];
    if (absolute(dirfd, path, abs) && under_root(abs)) emit(op, 0, 0, 0, abs, NULL, NULL, 0, 0);
}
int unlink(const char *p) { REAL(unlink); int r = real_unlink(p); if (r == 0) path_op(OP_UNLINK, AT_FDCWD, p); return r; }
int unlinkat(int d, const char *p, int flags) { REAL(unlinkat); int r = real_unlinkat(d, p, flags); if (r == 0) path_op(flags & AT_REMOVEDIR ? OP_RMDIR : OP_UNLINK, d, p); return r; }
int rmdir(const char *p) { REAL(rmdir); int r = real_rmdir(p); if (r == 0) path_op(OP_RMDIR, AT_FDCWD, p); return r; }
int mkdir(const char *p, mode_t m) { REAL(mkdir); int r = real_mkdir(p, m); if (r == 0) path_op(OP_MKDIR, AT_FDCWD, p); return r; }
int mkdirat(int d, const char *p, mode_t m) { REAL(mkdirat); int r = real_mkdirat(d, p, m); if (r == 0) path_op(OP_MKDIR, d, p); return r; }
int link(const char *a, const char *b) { REAL(link); int r = real_link(a, b); if (r == 0) path_op(OP_UNSUPPORTED, AT_FDCWD, b); return r; }
int linkat(int da, const char *a, int db, const char *b, int f) { REAL(linkat); int r = real_linkat(da, a, db, b, f); if (r == 0) path_op(OP_UNSUPPORTED, db, b); return r; }
ssize_t sendfile(int out, int in, off_t *off, size_t n) { REAL(sendfile); ssize_t r = real_sendfile(out, in, off, n); if (r > 0 && is_tracked(out)) emit(OP_UNSUPPORTED, out, 0, 0, "sendfile", NULL, NULL, 0, 0); return r; }
ssize_t copy_file_range(int in, off_t *oi, int out, off_t *oo, size_t n, unsigned f) { REAL(copy_file_range); ssize_t r = real_copy_file_range(in, oi, out, oo, n, f); if (r > 0 && is_tracked(out)) emit(OP_UNSUPPORTED, out, 0, 0, "copy_file_range", NULL, NULL, 0, 0); return r; }
