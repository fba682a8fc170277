/* Preloaded into a daemon by tests/store/test_deleter.py: a rename into one folder
 * (HOLD_SHIM_DIR, resolved: the tier's deleting folder) waits while a file (HOLD_SHIM_FILE)
 * exists, as a rename waiting on a busy file system journal does. Every other call passes. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static void hold_if_into_folder(const char *newpath) {
    const char *folder = getenv("HOLD_SHIM_DIR");
    const char *hold = getenv("HOLD_SHIM_FILE");
    if (!folder || !hold) return;
    char parent[PATH_MAX], resolved[PATH_MAX];
    size_t length = strlen(newpath);
    if (length >= sizeof parent) return;
    memcpy(parent, newpath, length + 1);
    char *slash = strrchr(parent, '/');
    if (!slash) return;
    *slash = '\0';
    if (realpath(parent, resolved) && strcmp(resolved, folder) == 0) {
        while (access(hold, F_OK) == 0) usleep(10000);
    }
}

int rename(const char *oldpath, const char *newpath) {
    static int (*real_rename)(const char *, const char *);
    if (!real_rename) real_rename = (int (*)(const char *, const char *))dlsym(RTLD_NEXT, "rename");
    hold_if_into_folder(newpath);
    return real_rename(oldpath, newpath);
}

int renameat(int olddirfd, const char *oldpath, int newdirfd, const char *newpath) {
    static int (*real_renameat)(int, const char *, int, const char *);
    if (!real_renameat)
        real_renameat = (int (*)(int, const char *, int, const char *))dlsym(RTLD_NEXT, "renameat");
    if (newpath[0] == '/') hold_if_into_folder(newpath);
    return real_renameat(olddirfd, oldpath, newdirfd, newpath);
}
