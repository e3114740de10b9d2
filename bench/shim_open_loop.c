/* The warm open of bench_shim_open.py, with no interpreter around it: COUNT times, open one of FILES files
 * of DIR (named 0, 1, ... FILES-1, round robin), fstat it, read it whole and close it, as a data loader's
 * worker reads one small sample file. Under tierstore's shim the open is answered from a tier's copy and
 * the fstat from what the open remembered; anywhere else these are the kernel's calls alone.
 *
 * With `fork`, the loop is a DataLoader's worker start instead: the program reads file 0 itself (under the
 * shim its engine starts), then COUNT times forks a child that reads one file and exits, and waits for it.
 * Its CPU time, children included, is then what each forked worker's first read costs.
 *
 *     shim_open_loop DIR FILES COUNT [fork]
 */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

static char buf[1 << 20];

/* Opens file `i` of `dir`, fstats it, reads it whole and closes it; 0, or 1 with the reason printed. */
static int read_one(const char *dir, long i) {
    char path[4096];
    struct stat st;
    snprintf(path, sizeof path, "%s/%ld", dir, i);
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
    return 0;
}

int main(int argc, char **argv) {
    int forking = argc == 5 && strcmp(argv[4], "fork") == 0;
    if (argc != 4 && !forking) {
        fprintf(stderr, "usage: %s DIR FILES COUNT [fork]\n", argv[0]);
        return 2;
    }
    const char *dir = argv[1];
    long files = atol(argv[2]), count = atol(argv[3]);
    if (forking && read_one(dir, 0) != 0) {
        return 1;
    }
    for (long i = 0; i < count; i++) {
        if (!forking) {
            if (read_one(dir, i % files) != 0) {
                return 1;
            }
            continue;
        }
        pid_t pid = fork();
        if (pid < 0) {
            perror("fork");
            return 1;
        }
        if (pid == 0) {
            _exit(read_one(dir, i % files));
        }
        int status;
        if (waitpid(pid, &status, 0) != pid || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
            fprintf(stderr, "a forked reader failed\n");
            return 1;
        }
    }
    return 0;
}
