/* A daemon process seen from outside, for isolation.c, load.c, badinput.c and
 * tests/security/fdattack.c: starting it with its output in a log file,
 * its open descriptors and resident memory, read from /proc. Test code
 * only. */
#ifndef MOEEP_E2E_ISOLATION_PROC_H
#define MOEEP_E2E_ISOLATION_PROC_H

#include <dirent.h>
#include <fcntl.h>
#include <stdio.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

/* Starts argv[0] with argv, its stdout and stderr going to `log_path`
 * (truncated); returns its pid, or -1. */
static inline pid_t proc_spawn_logged(char *const argv[], const char *log_path) {
        int logfd = open(log_path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
        pid_t pid;

        if (logfd < 0)
                return -1;
        pid = fork();
        if (pid == 0) {
                dup2(logfd, STDOUT_FILENO);
                dup2(logfd, STDERR_FILENO);
                execvp(argv[0], argv);
                _exit(127);
        }
        close(logfd);
        return pid;
}

static inline void sleep_ms(long ms) {
        struct timespec ts = { .tv_sec = ms / 1000, .tv_nsec = (ms % 1000) * 1000000 };

        nanosleep(&ts, NULL);
}

/* Entries of /proc/PID/fd, or -1. */
static inline int proc_count_fds(pid_t pid) {
        char path[64];
        struct dirent *e;
        DIR *d;
        int n = 0;

        snprintf(path, sizeof(path), "/proc/%d/fd", (int)pid);
        d = opendir(path);
        if (!d)
                return -1;
        while ((e = readdir(d)))
                n += e->d_name[0] != '.';
        closedir(d);
        return n;
}

/* Waits up to 10 s for `pid` to hold `want` descriptors (sessions end
 * asynchronously); returns the last count seen. */
static inline int proc_fds_settle(pid_t pid, int want) {
        int n = -1;

        for (int i = 0; i < 400; i++) {
                n = proc_count_fds(pid);
                if (n == want)
                        break;
                sleep_ms(25);
        }
        return n;
}

/* VmRSS of `pid` in KiB, or -1. */
static inline long proc_rss_kib(pid_t pid) {
        char path[64], line[256];
        long kib = -1;
        FILE *f;

        snprintf(path, sizeof(path), "/proc/%d/status", (int)pid);
        f = fopen(path, "r");
        if (!f)
                return -1;
        while (fgets(line, sizeof(line), f))
                if (sscanf(line, "VmRSS: %ld kB", &kib) == 1)
                        break;
        fclose(f);
        return kib;
}

#endif
