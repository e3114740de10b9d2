/* The warm open of bench_shim_open.py, with no interpreter around it: COUNT times, open one of FILES files
 * of DIR (named 0, 1, ... FILES-1, round robin), fstat it, read it whole and close it, as a data loader's
 * worker reads one small sample file. Under tierstore's shim the open is answered from a tier's copy and
 * the fstat from what the open remembered; anywhere else these are the kernel's calls alone.
 *
 *     shim_open_loop DIR FILES COUNT
 */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: %s DIR FILES COUNT\n", argv[0]);
        return 2;
    }
    const char *dir = argv[1];
    long files = atol(argv[2]), count = atol(argv[3]);
    static char buf[1 << 20];
    char path[4096];
    struct stat st;
    for (long i = 0; i < count; i++) {
        snprintf(path, sizeof path, "%s/%ld", dir, i % files);
        int fd = open(path, O_RDONLY | O_CLOEXEC);
        if (fd < 0) {
            perror(path);
            return 1;
        }
        if (fstat(fd, &st) != 0 || st.st_size > (off_t)sizeof buf || read(fd, buf, sizeof buf) != st.st_size) {
            fprintf(stderr, "%s: not read whole\n", path);
            return 1;
        }
        close(fd);
    }
    return 0;
}
