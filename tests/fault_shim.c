/* An LD_PRELOAD shim that makes file calls under one folder fail at random, with EIO or
 * ENOSPC, and counts what it did.
 *
 * Why not libfiu's POSIX preload: it has no fault point for mkdir or posix_fallocate, cannot
 * keep to one folder (a failed write to the log or a failed read of a Python module is not
 * the fault under test), and keeps no count of the faults it injected.
 *
 * Environment: FAULT_SHIM_ROOT, the folder whose files may fail (paths under it; descriptors
 * opened on them); FAULT_SHIM_CONTROL, a file of struct control (below) that the test maps
 * too: it turns faults on and off and reads the counts while the process runs.
 *
 * A file whose fsync failed is remembered (by device and inode): after EIO, Linux may drop its
 * dirty pages and mark them clean, so a later fsync succeeds with the data lost. The shim
 * counts the successful fsyncs of such a file and its renames into the tier's entries folder:
 * either is the daemon taking a file it could not sync for durable.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <unistd.h>

enum op { OP_OPEN, OP_READ, OP_WRITE, OP_PREAD, OP_PWRITE, OP_FSYNC, OP_RENAME, OP_MKDIR,
          OP_FALLOCATE, OP_COUNT };

struct control {  /* no padding: 4 + 9 * 4 bytes come before the counts */
    volatile int32_t enabled;
    volatile int32_t per_million[OP_COUNT];  /* the chance of a fault per call, in millionths */
    volatile int64_t calls[OP_COUNT];  /* calls that could have failed while enabled */
    volatile int64_t injected[OP_COUNT][2];  /* faults injected: [op][0] EIO, [op][1] ENOSPC */
    volatile int64_t skip_faults;  /* pass over the first this many faults drawn */
    volatile int64_t max_faults;  /* inject no more than this many in all; 0: no limit */
    volatile int64_t synced_after_failure;  /* fsyncs that succeeded on a file that failed one */
    volatile int64_t placed_after_failure;  /* renames of such a file into <root>/entries/ */
};

#define MAX_POISONED 4096
static struct { dev_t dev; ino_t ino; } poisoned[MAX_POISONED];  /* files whose fsync failed */
static int poisoned_count;
static int64_t faults_drawn;  /* faults drawn so far (injected or passed over) */

#define MAX_FDS 65536
static unsigned char tracked[MAX_FDS];  /* descriptors opened on files under the root */
static struct control *control;
static char root[4096];
static size_t root_length;
static uint64_t state = 88172645463325252ULL;

static int (*real_open)(const char *, int, ...);
static int (*real_open64)(const char *, int, ...);
static int (*real_openat)(int, const char *, int, ...);
static int (*real_close)(int);
static ssize_t (*real_read)(int, void *, size_t);
static ssize_t (*real_write)(int, const void *, size_t);
static ssize_t (*real_pread)(int, void *, size_t, off_t);
static ssize_t (*real_pwrite)(int, const void *, size_t, off_t);
static ssize_t (*real_pread64)(int, void *, size_t, off_t);
static ssize_t (*real_preadv)(int, const struct iovec *, int, off_t);
static ssize_t (*real_preadv64)(int, const struct iovec *, int, off_t);
static ssize_t (*real_pwrite64)(int, const void *, size_t, off_t);
static int (*real_fsync)(int);
static int (*real_fdatasync)(int);
static int (*real_rename)(const char *, const char *);
static int (*real_mkdir)(const char *, mode_t);
static int (*real_unlink)(const char *);
static int (*real_posix_fallocate)(int, off_t, off_t);
static int (*real_posix_fallocate64)(int, off_t, off_t);

__attribute__((constructor)) static void start(void) {
    real_open = dlsym(RTLD_NEXT, "open");
    real_open64 = dlsym(RTLD_NEXT, "open64");
    real_openat = dlsym(RTLD_NEXT, "openat");
    real_close = dlsym(RTLD_NEXT, "close");
    real_read = dlsym(RTLD_NEXT, "read");
    real_write = dlsym(RTLD_NEXT, "write");
    real_pread = dlsym(RTLD_NEXT, "pread");
    real_pwrite = dlsym(RTLD_NEXT, "pwrite");
    real_pread64 = dlsym(RTLD_NEXT, "pread64");
    real_preadv = dlsym(RTLD_NEXT, "preadv");
    real_preadv64 = dlsym(RTLD_NEXT, "preadv64");
    real_pwrite64 = dlsym(RTLD_NEXT, "pwrite64");
    real_fsync = dlsym(RTLD_NEXT, "fsync");
    real_fdatasync = dlsym(RTLD_NEXT, "fdatasync");
    real_rename = dlsym(RTLD_NEXT, "rename");
    real_mkdir = dlsym(RTLD_NEXT, "mkdir");
    real_unlink = dlsym(RTLD_NEXT, "unlink");
    real_posix_fallocate = dlsym(RTLD_NEXT, "posix_fallocate");
    real_posix_fallocate64 = dlsym(RTLD_NEXT, "posix_fallocate64");
    const char *folder = getenv("FAULT_SHIM_ROOT");
    const char *path = getenv("FAULT_SHIM_CONTROL");
    if (!folder || !path || strlen(folder) >= sizeof root) return;
    int fd = real_open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0) return;
    void *mapped = mmap(NULL, sizeof(struct control), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    real_close(fd);
    if (mapped == MAP_FAILED) return;
    strcpy(root, folder);
    root_length = strlen(root);
    state ^= (uint64_t)getpid() << 17;
    control = mapped;
}

static int under_root(const char *path) {
    return control && path && strncmp(path, root, root_length) == 0 &&
           (path[root_length] == '/' || path[root_length] == '\0');
}

static int is_tracked(int fd) { return fd >= 0 && fd < MAX_FDS && tracked[fd]; }

/* Whether this call fails: sets errno to EIO or ENOSPC and counts it. */
static int fault(enum op op) {
    if (!control || !control->enabled) return 0;
    __atomic_add_fetch(&control->calls[op], 1, __ATOMIC_RELAXED);
    uint64_t x = __atomic_load_n(&state, __ATOMIC_RELAXED);  /* xorshift64: races only mix it */
    x ^= x << 13; x ^= x >> 7; x ^= x << 17;
    __atomic_store_n(&state, x, __ATOMIC_RELAXED);
    if ((int64_t)(x % 1000000) >= control->per_million[op]) return 0;
    int64_t drawn = __atomic_fetch_add(&faults_drawn, 1, __ATOMIC_RELAXED);
    if (drawn < control->skip_faults) return 0;
    if (control->max_faults > 0 && drawn - control->skip_faults >= control->max_faults) return 0;
    int which = (int)((x >> 32) & 1);
    __atomic_add_fetch(&control->injected[op][which], 1, __ATOMIC_RELAXED);
    errno = which ? ENOSPC : EIO;
    return 1;
}

static int opened(int fd, const char *path) {
    if (fd >= 0 && fd < MAX_FDS) tracked[fd] = under_root(path);
    return fd;
}

static mode_t mode_of(int flags, va_list args) {
    return (flags & (O_CREAT | O_TMPFILE)) ? (mode_t)va_arg(args, int) : 0;
}

int open(const char *path, int flags, ...) {
    va_list args; va_start(args, flags); mode_t mode = mode_of(flags, args); va_end(args);
    if (under_root(path) && fault(OP_OPEN)) return -1;
    return opened(real_open(path, flags, mode), path);
}

int open64(const char *path, int flags, ...) {
    va_list args; va_start(args, flags); mode_t mode = mode_of(flags, args); va_end(args);
    if (under_root(path) && fault(OP_OPEN)) return -1;
    return opened(real_open64(path, flags, mode), path);
}

int openat(int dirfd, const char *path, int flags, ...) {
    va_list args; va_start(args, flags); mode_t mode = mode_of(flags, args); va_end(args);
    if (under_root(path) && fault(OP_OPEN)) return -1;
    return opened(real_openat(dirfd, path, flags, mode), path);
}

int close(int fd) {
    if (fd >= 0 && fd < MAX_FDS) tracked[fd] = 0;
    return real_close(fd);
}

ssize_t read(int fd, void *buffer, size_t count) {
    if (is_tracked(fd) && fault(OP_READ)) return -1;
    return real_read(fd, buffer, count);
}

ssize_t write(int fd, const void *buffer, size_t count) {
    if (is_tracked(fd) && fault(OP_WRITE)) return -1;
    return real_write(fd, buffer, count);
}

ssize_t pread(int fd, void *buffer, size_t count, off_t offset) {
    if (is_tracked(fd) && fault(OP_PREAD)) return -1;
    return real_pread(fd, buffer, count, offset);
}

ssize_t pread64(int fd, void *buffer, size_t count, off_t offset) {
    if (is_tracked(fd) && fault(OP_PREAD)) return -1;
    return real_pread64(fd, buffer, count, offset);
}

/* preadv counts as pread: the daemon checks slots by preadv into one buffer. */
ssize_t preadv(int fd, const struct iovec *iov, int count, off_t offset) {
    if (is_tracked(fd) && fault(OP_PREAD)) return -1;
    return real_preadv(fd, iov, count, offset);
}

ssize_t preadv64(int fd, const struct iovec *iov, int count, off_t offset) {
    if (is_tracked(fd) && fault(OP_PREAD)) return -1;
    return real_preadv64(fd, iov, count, offset);
}

ssize_t pwrite(int fd, const void *buffer, size_t count, off_t offset) {
    if (is_tracked(fd) && fault(OP_PWRITE)) return -1;
    return real_pwrite(fd, buffer, count, offset);
}

ssize_t pwrite64(int fd, const void *buffer, size_t count, off_t offset) {
    if (is_tracked(fd) && fault(OP_PWRITE)) return -1;
    return real_pwrite64(fd, buffer, count, offset);
}

/* The index of a regular file's inode among the poisoned, or -1. */
static int poisoned_index(const struct stat *info) {
    int count = __atomic_load_n(&poisoned_count, __ATOMIC_ACQUIRE);
    for (int i = 0; i < count && i < MAX_POISONED; i++)
        if (poisoned[i].dev == info->st_dev && poisoned[i].ino == info->st_ino) return i;
    return -1;
}

static void poison(int fd) {
    struct stat info;
    if (fstat(fd, &info) != 0 || !S_ISREG(info.st_mode) || poisoned_index(&info) >= 0) return;
    int slot = __atomic_fetch_add(&poisoned_count, 1, __ATOMIC_ACQ_REL);
    if (slot >= MAX_POISONED) return;
    poisoned[slot].dev = info.st_dev;
    poisoned[slot].ino = info.st_ino;
}

/* A file sync: failed on purpose (and the file remembered), or real, and counted if the file
 * failed one before. */
static int synced(int fd, int (*real)(int)) {
    if (!is_tracked(fd)) return real(fd);
    if (fault(OP_FSYNC)) {
        int saved = errno;
        poison(fd);
        errno = saved;
        return -1;
    }
    int result = real(fd);
    struct stat info;
    if (result == 0 && control && fstat(fd, &info) == 0 && poisoned_index(&info) >= 0)
        __atomic_add_fetch(&control->synced_after_failure, 1, __ATOMIC_RELAXED);
    return result;
}

int fsync(int fd) { return synced(fd, real_fsync); }

/* A poisoned file unlinked is forgotten: its inode number may be given to a new file. */
int unlink(const char *path) {
    struct stat info;
    if (control && lstat(path, &info) == 0) {
        int index = poisoned_index(&info);
        if (index >= 0) poisoned[index].ino = 0;
    }
    return real_unlink(path);
}

int fdatasync(int fd) { return synced(fd, real_fdatasync); }

static int into_entries(const char *path) {
    return under_root(path) && strncmp(path + root_length, "/entries/", 9) == 0;
}

int rename(const char *from, const char *to) {
    if ((under_root(from) || under_root(to)) && fault(OP_RENAME)) return -1;
    struct stat info;
    if (into_entries(to) && stat(from, &info) == 0 && poisoned_index(&info) >= 0)
        __atomic_add_fetch(&control->placed_after_failure, 1, __ATOMIC_RELAXED);
    return real_rename(from, to);
}

int mkdir(const char *path, mode_t mode) {
    if (under_root(path) && fault(OP_MKDIR)) return -1;
    return real_mkdir(path, mode);
}

/* posix_fallocate reports its error as its result, not in errno. */
int posix_fallocate(int fd, off_t offset, off_t length) {
    if (is_tracked(fd) && fault(OP_FALLOCATE)) return errno;
    return real_posix_fallocate(fd, offset, length);
}

int posix_fallocate64(int fd, off_t offset, off_t length) {
    if (is_tracked(fd) && fault(OP_FALLOCATE)) return errno;
    return real_posix_fallocate64(fd, offset, length);
}
