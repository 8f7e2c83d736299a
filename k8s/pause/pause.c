/* The test cluster's pause program: the process that holds a pod's namespaces open while its
 * containers come and go. No registry can be reached from the test machines, so the harness
 * builds its sandbox image from this file (gcc -static): it must run in an image that holds
 * nothing else. It sleeps until SIGINT or SIGTERM and reaps the zombies that a shared pid
 * namespace hands it. */
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>
#include <sys/wait.h>

static void stop(int sig) {
    (void)sig;
    _exit(0);
}

static void reap(int sig) {
    (void)sig;
    while (waitpid(-1, NULL, WNOHANG) > 0) {
    }
}

int main(int argc, char **argv) {
    struct sigaction sa;
    if (argc > 1 && strcmp(argv[1], "-v") == 0) {
        puts("devbroker-pause 1");
        return 0;
    }
    if (getpid() != 1)
        fputs("pause: not running as pid 1\n", stderr);
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = stop;
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    sa.sa_handler = reap;
    sa.sa_flags = SA_NOCLDSTOP;
    sigaction(SIGCHLD, &sa, NULL);
    for (;;)
        pause();
    return 1;
}
