/* Preloaded into a daemon by tests/store/test_startup_listing.py: opendir() of one folder
 * (HOLD_SHIM_DIR, resolved) waits while a file (HOLD_SHIM_FILE) exists, so that a test can
 * act while start-up's listing of the entries folder has not begun. Every other call passes. */
#define _GNU_SOURCE
#include <dirent.h>
#include <dlfcn.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

DIR *opendir(const char *name) {
    static DIR *(*real_opendir)(const char *);
    if (!real_opendir) real_opendir = (DIR * (*)(const char *)) dlsym(RTLD_NEXT, "opendir");
    const char *folder = getenv("HOLD_SHIM_DIR");
    const char *hold = getenv("HOLD_SHIM_FILE");
    char resolved[PATH_MAX];
    if (folder && hold && realpath(name, resolved) && strcmp(resolved, folder) == 0) {
        while (access(hold, F_OK) == 0) usleep(10000);
    }
    return real_opendir(name);
}
