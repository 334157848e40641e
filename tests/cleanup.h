/* What a test program that starts processes and files in a temporary
 * directory removes on every way out: at exit, and when the bound on its
 * whole run (SIGALRM) fires. Shared by tests/e2e/isolation.c, load.c and
 * badinput.c; test code.
 *
 * The test registers its processes (the address of each pid variable, -1
 * or 0 while there is none), its files and its directory (once mkdtemp()
 * made it), then cleanup_arm(). Cleaning up SIGKILLs and reaps the
 * processes in the order they were registered, unlinks the files, then
 * removes the directory; it runs once, and only async-signal-safe calls,
 * so the alarm handler can do it too. Paths are held by address: a test
 * may register a buffer before it writes the path into it. */
#ifndef MOEEP_TESTS_CLEANUP_H
#define MOEEP_TESTS_CLEANUP_H

#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#define CLEANUP_MAX 8

static struct {
        pid_t *pids[CLEANUP_MAX]; /* not owned */
        int npids;
        const char *files[CLEANUP_MAX]; /* not owned; "" while not written */
        int nfiles;
        const char *dir;         /* not owned; NULL until made */
        char admin_dir[128];     /* dir + "-admin": where its daemons put their admin sockets */
        char admin_sock[160];    /* admin_dir + "/moeepd.sock" */
        const char *timeout_msg; /* written to stdout when the alarm fires */
} cleanup_state;

static inline void cleanup_add_pid(pid_t *pid) {
        if (cleanup_state.npids < CLEANUP_MAX)
                cleanup_state.pids[cleanup_state.npids++] = pid;
}

static inline void cleanup_add_file(const char *path) {
        if (cleanup_state.nfiles < CLEANUP_MAX)
                cleanup_state.files[cleanup_state.nfiles++] = path;
}

/* `dir` exists (mkdtemp() succeeded) and is removed last, after the admin
 * socket directory a daemon on `dir`/moeepd.sock makes beside it
 * (proto/admin-socket.h). */
static inline void cleanup_add_dir(const char *dir) {
        cleanup_state.dir = dir;
        snprintf(cleanup_state.admin_dir, sizeof(cleanup_state.admin_dir), "%s-admin", dir);
        snprintf(cleanup_state.admin_sock, sizeof(cleanup_state.admin_sock), "%s/moeepd.sock",
                 cleanup_state.admin_dir);
}

static void cleanup_run(void) {
        for (int i = 0; i < cleanup_state.npids; i++) {
                pid_t *pid = cleanup_state.pids[i];

                if (*pid > 0) {
                        kill(*pid, SIGKILL);
                        waitpid(*pid, NULL, 0);
                        *pid = -1;
                }
        }
        for (int i = 0; i < cleanup_state.nfiles; i++)
                if (cleanup_state.files[i][0])
                        unlink(cleanup_state.files[i]);
        if (cleanup_state.dir) {
                rmdir(cleanup_state.dir);
                unlink(cleanup_state.admin_sock);
                rmdir(cleanup_state.admin_dir);
                cleanup_state.dir = NULL;
        }
}

static void cleanup_on_alarm(int sig) {
        const char *msg = cleanup_state.timeout_msg;

        (void)sig;
        (void)!write(STDOUT_FILENO, msg, strlen(msg));
        cleanup_run();
        _exit(1);
}

/* Cleans up at exit, and after `seconds` ends the test: `timeout_msg` (a
 * whole line, "NAME: timed out\n") on stdout, cleanup, exit status 1. */
static inline void cleanup_arm(unsigned seconds, const char *timeout_msg) {
        cleanup_state.timeout_msg = timeout_msg;
        signal(SIGALRM, cleanup_on_alarm);
        alarm(seconds);
        atexit(cleanup_run);
}

#endif
