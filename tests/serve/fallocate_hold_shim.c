/* Preloaded into a daemon by tests/serve/test_hostile_connections.py: posix_fallocate() of
 * HOLD_SHIM_SIZE bytes waits while a file (HOLD_SHIM_FILE) exists, so that a test can act
 * while a worker thread is making staging files. Every other call passes. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stdlib.h>
#include <unistd.h>

static void hold(off_t len) {
    const char *size = getenv("HOLD_SHIM_SIZE");
    const char *file = getenv("HOLD_SHIM_FILE");
    if (size && file && len == (off_t)atoll(size)) {
        while (access(file, F_OK) == 0) usleep(10000);
    }
}

int posix_fallocate(int fd, off_t offset, off_t len) {
    static int (*real)(int, off_t, off_t);
    if (!real) real = (int (*)(int, off_t, off_t))dlsym(RTLD_NEXT, "posix_fallocate");
    hold(len);
    return real(fd, offset, len);
}

int posix_fallocate64(int fd, off_t offset, off_t len) {
    static int (*real)(int, off_t, off_t);
    if (!real) real = (int (*)(int, off_t, off_t))dlsym(RTLD_NEXT, "posix_fallocate64");
    hold(len);
    return real(fd, offset, len);
}
