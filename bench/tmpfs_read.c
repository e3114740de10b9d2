/* What reading a whole small file costs the kernel from a tmpfs tier against a local file system's page
 * cache, with no cache in between: the CPU time (user + system, getrusage) of open, fstat, a read of the
 * whole file and close, over N files of SIZE bytes in each directory, and of the same with the read
 * replaced by mmap and a copy out (with and without MAP_POPULATE), in paired rounds.
 *
 *     cc -O2 -o /tmp/tmpfs_read bench/tmpfs_read.c
 *     /tmp/tmpfs_read /tmp/tmpfs-read-local /dev/shm/tmpfs-read 2000 131072 5 5
 *
 * Writes the files first when a directory lacks them (random bytes, the same in both directories), reads
 * each directory once before the rounds so that every page is in memory, and prints one line a round.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

enum { READ, MAP, MAP_POPULATED };

static char *buf;

static double cpu_seconds(void) {
    struct rusage r;
    getrusage(RUSAGE_SELF, &r);
    return r.ru_utime.tv_sec + r.ru_utime.tv_usec / 1e6 + r.ru_stime.tv_sec + r.ru_stime.tv_usec / 1e6;
}

static void make_files(const char *dir, int n, size_t size) {
    char path[4096];
    mkdir(dir, 0700);
    srand(1);
    for (int i = 0; i < n; i++) {
        snprintf(path, sizeof path, "%s/f%05d", dir, i);
        for (size_t k = 0; k < size; k++) buf[k] = (char)rand();
        int fd = open(path, O_WRONLY | O_CREAT | O_EXCL, 0600);
        if (fd < 0) continue; /* there already */
        if (write(fd, buf, size) != (ssize_t)size) { perror(path); exit(1); }
        close(fd);
    }
}

static double pass(const char *dir, int n, size_t size, int how, int passes) {
    char path[4096];
    long total = 0;
    double start = cpu_seconds();
    for (int p = 0; p < passes; p++) {
        for (int i = 0; i < n; i++) {
            snprintf(path, sizeof path, "%s/f%05d", dir, i);
            int fd = open(path, O_RDONLY);
            struct stat st;
            if (fd < 0 || fstat(fd, &st) != 0) { perror(path); exit(1); }
            if (how == READ) {
                total += read(fd, buf, st.st_size);
            } else {
                int flags = MAP_PRIVATE | (how == MAP_POPULATED ? MAP_POPULATE : 0);
                void *m = mmap(NULL, st.st_size, PROT_READ, flags, fd, 0);
                if (m == MAP_FAILED) { perror(path); exit(1); }
                memcpy(buf, m, st.st_size);
                munmap(m, st.st_size);
                total += st.st_size;
            }
            close(fd);
        }
    }
    double spent = cpu_seconds() - start;
    if (total != (long)passes * n * (long)size) {
        fprintf(stderr, "%s: read %ld bytes, expected %ld\n", dir, total, (long)passes * n * (long)size);
        exit(1);
    }
    return spent;
}

int main(int argc, char **argv) {
    if (argc != 7) {
        fprintf(stderr, "usage: %s LOCAL_DIR TMPFS_DIR FILES SIZE PASSES ROUNDS\n", argv[0]);
        return 2;
    }
    const char *local = argv[1], *tmpfs = argv[2];
    int n = atoi(argv[3]), passes = atoi(argv[5]), rounds = atoi(argv[6]);
    size_t size = (size_t)atol(argv[4]);
    buf = malloc(size);
    make_files(local, n, size);
    make_files(tmpfs, n, size);
    pass(local, n, size, READ, 1);
    pass(tmpfs, n, size, READ, 1);
    printf("round | local read | tmpfs read | tmpfs mmap | tmpfs mmap populated | local/read | local/mmap | "
           "local/populated (CPU seconds of %d passes over %d files of %zu bytes)\n", passes, n, size);
    for (int r = 1; r <= rounds; r++) {
        double a = pass(local, n, size, READ, passes), b = pass(tmpfs, n, size, READ, passes);
        double c = pass(tmpfs, n, size, MAP, passes), d = pass(tmpfs, n, size, MAP_POPULATED, passes);
        printf("%d | %.3f | %.3f | %.3f | %.3f | %.2f | %.2f | %.2f\n", r, a, b, c, d, a / b, a / c, a / d);
    }
    return 0;
}
