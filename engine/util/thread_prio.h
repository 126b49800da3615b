/* The priority of the engine's background threads (the tokenizer thread, the module's
 * JSON thread). They turn request bodies into work for the engine thread; on a busy
 * machine they must not take the cores from the engine thread or nginx's event loop,
 * whose delays every running stream sees as a stalled token (issue 25's long-prompt
 * stall: a 1 MB body parsed and tokenized beside eight streams). */
#ifndef M40_THREAD_PRIO_H
#define M40_THREAD_PRIO_H

/* Raises the calling thread's nice value by `by` (Linux: per thread; elsewhere nothing).
 * Failures are ignored: a thread at normal priority is still correct. */
void m40_thread_background(int by);

/* the nice increment the background threads take */
#define M40_BACKGROUND_NICE 10

#endif
