/* harness.c: the pass/fail bookkeeping of the C test runner (test_kernels.c, test_api.c): check()
 * counts or records a failure, case_begin()/case_end() make one case one count, and watchdog() turns
 * a hang (a thread pool that never returns) into a named failure instead of a stuck CI job. */
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <unistd.h>

int n_pass, n_fail, verbose;
int small_mode;
const char *cur_isa = "";
static int fails_shown;

static int in_case, case_bad;
static char case_msg[512];

/* Inside case_begin() .. case_end() a check only records its first failure: one case, one count. */
int check(int ok, const char *fmt, ...) {
    if (in_case) {
        if (!ok && !case_bad++) {
            va_list ap;
            va_start(ap, fmt);
            vsnprintf(case_msg, sizeof case_msg, fmt, ap);
            va_end(ap);
        }
        return ok;
    }
    if (ok) { n_pass++; return 1; }
    n_fail++;
    if (fails_shown++ < 60 || verbose) {
        va_list ap;
        va_start(ap, fmt);
        printf("  FAIL [%s] ", cur_isa);
        vprintf(fmt, ap);
        printf("\n");
        va_end(ap);
    }
    return 0;
}

void case_begin(void) { in_case = 1; case_bad = 0; }
void case_end(void) {
    in_case = 0;
    if (!case_bad) { n_pass++; return; }
    n_fail++;
    if (fails_shown++ < 60 || verbose) {
        if (case_bad > 1) printf("  FAIL [%s] %s (and %d more in this case)\n", cur_isa, case_msg, case_bad - 1);
        else printf("  FAIL [%s] %s\n", cur_isa, case_msg);
    }
}

static const char *watch_what;
int watch_seconds = 120;
static void on_alarm(int sig) {
    (void)sig;
    char buf[256];
    int n = snprintf(buf, sizeof buf, "  FAIL [%s] %s did not finish within %d s (hang?)\n%d passed, %d failed\n",
                     cur_isa, watch_what ? watch_what : "?", watch_seconds, n_pass, n_fail + 1);
    if (write(1, buf, (size_t)n) < 0) _exit(1);
    _exit(1);
}
void watchdog(const char *what) {
    watch_what = what;
    signal(SIGALRM, on_alarm);
    alarm(what ? (unsigned)watch_seconds : 0);
}

