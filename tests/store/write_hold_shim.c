/* Preloaded into an engine process by tests/store/test_cancelled_put.py. The first write
 * (pwrite, pwritev) into a file under WRITE_HOLD_ROOT waits while WRITE_HOLD_FILE exists, so
 * that the test can give the put up while that write is under way. Appended to WRITE_HOLD_LOG:
 *   held FD       the held write has begun;
 *   wrote FD      it has ended;
 *   closed FD     the held write's descriptor was closed;
 *   busy FD       a descriptor was closed while a write into it was under way (never right).
 * Every other call passes. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <unistd.h>

#define MAX_FDS 65536

static int writing[MAX_FDS]; /* writes under way, per descriptor */
static int held_fd = -1;
static int hold_taken;

static int (*real_close)(int);

static void note(const char *what, int fd) {
    const char *path = getenv("WRITE_HOLD_LOG");
    if (!path) return;
    if (!real_close) real_close = (int (*)(int))dlsym(RTLD_NEXT, "close");
    int log = open(path, O_WRONLY | O_APPEND | O_CREAT, 0600);
    if (log < 0) return;
    char line[64];
    int n = snprintf(line, sizeof line, "%s %d\n", what, fd);
    if (write(log, line, n) != n) { /* nothing to do: the test then finds no line */ }
    real_close(log);
}

static int under_root(int fd) {
    const char *root = getenv("WRITE_HOLD_ROOT");
    if (!root || fd < 0 || fd >= MAX_FDS) return 0;
    char link[64], target[PATH_MAX];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, target, sizeof target - 1);
    if (n < 0) return 0;
    target[n] = 0;
    return strncmp(target, root, strlen(root)) == 0;
}

/* Called before a write into fd: counts it, and holds the first one under the root. */
static int begin_write(int fd) {
    if (!under_root(fd)) return 0;
    __atomic_add_fetch(&writing[fd], 1, __ATOMIC_SEQ_CST);
    const char *hold = getenv("WRITE_HOLD_FILE");
    if (hold && access(hold, F_OK) == 0 && !__atomic_exchange_n(&hold_taken, 1, __ATOMIC_SEQ_CST)) {
        __atomic_store_n(&held_fd, fd, __ATOMIC_SEQ_CST);
        note("held", fd);
        while (access(hold, F_OK) == 0) usleep(10000);
        return 2;
    }
    return 1;
}

static void end_write(int fd, int begun) {
    if (!begun) return;
    if (begun == 2) note("wrote", fd);
    __atomic_sub_fetch(&writing[fd], 1, __ATOMIC_SEQ_CST);
}

#define WRAP(ret, name, params, args)                                    \
    ret name params {                                                    \
        static ret (*real) params;                                       \
        if (!real) real = (ret(*) params)dlsym(RTLD_NEXT, #name);        \
        int begun = begin_write(fd);                                     \
        ret result = real args;                                          \
        end_write(fd, begun);                                            \
        return result;                                                   \
    }

WRAP(ssize_t, pwrite, (int fd, const void *buf, size_t n, off_t at), (fd, buf, n, at))
WRAP(ssize_t, pwrite64, (int fd, const void *buf, size_t n, off_t at), (fd, buf, n, at))
WRAP(ssize_t, pwritev, (int fd, const struct iovec *iov, int count, off_t at), (fd, iov, count, at))
WRAP(ssize_t, pwritev64, (int fd, const struct iovec *iov, int count, off_t at), (fd, iov, count, at))
WRAP(ssize_t, pwritev2, (int fd, const struct iovec *iov, int count, off_t at, int flags),
     (fd, iov, count, at, flags))
WRAP(ssize_t, pwritev64v2, (int fd, const struct iovec *iov, int count, off_t at, int flags),
     (fd, iov, count, at, flags))

int close(int fd) {
    if (!real_close) real_close = (int (*)(int))dlsym(RTLD_NEXT, "close");
    if (fd >= 0 && fd < MAX_FDS && __atomic_load_n(&writing[fd], __ATOMIC_SEQ_CST) > 0)
        note("busy", fd);
    if (fd >= 0 && fd == __atomic_load_n(&held_fd, __ATOMIC_SEQ_CST)) {
        __atomic_store_n(&held_fd, -1, __ATOMIC_SEQ_CST);
        note("closed", fd);
    }
    return real_close(fd);
}
