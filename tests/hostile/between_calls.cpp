// hostile: tries every way for its code to run between the judge's calls: an interval timer (its
// handler would run whenever the signal lands), a POSIX timer, leaving the judge's core to run
// beside it, and last a thread (which ends the process)
// expect: HOSTILE setitimer -> -1 (Operation not permitted)
// targets: cpu
#include <csignal>
#include <ctime>
#include <pthread.h>
#include <sched.h>
#include <sys/time.h>

#include "hostile.h"

static void on_alarm(int) {}
static void *worker(void *) { return nullptr; }

KOPT_EXPORT int ENTRY(const kopt_tensor *, int32_t, void *) {
  signal(SIGALRM, on_alarm);
  struct itimerval every = {{0, 1000}, {0, 1000}};
  say("setitimer", setitimer(ITIMER_REAL, &every, nullptr));
  timer_t timer;
  struct sigevent ev = {};
  ev.sigev_notify = SIGEV_SIGNAL;
  ev.sigev_signo = SIGALRM;
  say("timer_create", timer_create(CLOCK_MONOTONIC, &ev, &timer));
  cpu_set_t all;
  CPU_ZERO(&all);
  for (int c = 0; c < 64; ++c) CPU_SET(c, &all);
  say("sched_setaffinity", sched_setaffinity(0, sizeof all, &all));
  fflush(stderr);
  pthread_t t;
  say("pthread_create", pthread_create(&t, nullptr, worker, nullptr));
  return finish();
}
