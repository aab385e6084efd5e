"""A deliberately wrong solution of exercise 17.2: it admits waiting requests without counting their blocks.
The grader must fail it on the case named FAILS_CASE, with SAYS in its message (tests/test_exercises.py)."""

FAILS_CASE = "eight short requests at once in a tight pool"
SAYS = "over-commits the pool"


def schedule_step(state: dict) -> dict:
    bs, free, budget = state["block_size"], state["free_blocks"], state["max_batch_tokens"]
    queue, run, preempt = list(state["running"]), [], []
    while queue and budget:
        seq = queue.pop(0)
        n = min(seq["tokens"] - seq["computed"], budget)
        need = -(-(seq["computed"] + n) // bs) - seq["blocks"]
        while need > free and queue:                          # preempt the newest until this one fits
            victim = queue.pop()
            preempt.append(victim["id"])
            free += victim["blocks"]
        if need > free:                                       # no one left to preempt: wait itself
            preempt.append(seq["id"])
            free += seq["blocks"]
            continue
        run.append([seq["id"], n])
        free, budget = free - need, budget - n
    for seq in state["waiting"]:
        n = min(seq["tokens"], budget)
        need = -(-n // bs)
        if n == 0:                                            # the bug: blocks not counted on admission
            break
        run.append([seq["id"], n])
        free, budget = free - need, budget - n
    return {"preempt": preempt, "run": run}

