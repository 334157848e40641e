/* A daemon process seen from outside, for isolation.c, load.c, badinput.c and
 * tests/security/fdattack.c: starting it with its output in a log file,
 * its open descriptors and resident memory, read from /proc. Test code
 * only. */
#ifndef MOEEP_E2E_ISOLATION_PROC_H
#define MOEEP_E2E_ISOLATION_PROC_H

#include <dirent.h>
#include <fcntl.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/un.h>
#include <sys/wait.h>
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

/* Starts moeepd (`moeepd`) from the configuration file `conf_path`, its
 * output into `log_path`, and waits up to 10 s for it to accept on the
 * Unix socket `sock_path`. Returns 0 with *ret_pid, or -1 (*ret_pid -1
 * when it exited, else still its pid for the caller's cleanup). */
static inline int proc_start_moeepd(const char *moeepd, const char *conf_path, const char *log_path,
                                    const char *sock_path, pid_t *ret_pid) {
        struct sockaddr_un a = { .sun_family = AF_UNIX };

        snprintf(a.sun_path, sizeof(a.sun_path), "%s", sock_path);
        *ret_pid =
                proc_spawn_logged((char *const[]){ (char *)moeepd, "-c", (char *)conf_path, NULL }, log_path);
        if (*ret_pid < 0)
                return -1;
        for (int i = 0; i < 400; i++) {
                int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
                bool up = fd >= 0 && connect(fd, (const struct sockaddr *)&a, sizeof(a)) == 0;

                if (fd >= 0)
                        close(fd);
                if (up)
                        return 0;
                if (waitpid(*ret_pid, NULL, WNOHANG) == *ret_pid) {
                        *ret_pid = -1;
                        return -1;
                }
                sleep_ms(25);
        }
        return -1;
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
