/* See thread_prio.h. */
#include "thread_prio.h"

#if defined(__linux__)
#include <errno.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

void m40_thread_background(int by)
{
    /* On Linux, PRIO_PROCESS with a thread id sets that thread's nice value alone. */
    const id_t tid = (id_t)syscall(SYS_gettid);
    errno = 0;
    const int now = getpriority(PRIO_PROCESS, tid);
    if (now == -1 && errno)
        return;
    (void)setpriority(PRIO_PROCESS, tid, now + by > 19 ? 19 : now + by);
}
#else
void m40_thread_background(int by) { (void)by; }
#endif
