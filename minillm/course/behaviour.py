"""Behaviour exercises: the student writes a policy (which requests to run, which blocks to free, which
tokens to accept), not a formula. Each step the grader shows the policy the state as data, the policy
answers with its decision as data, and the grader replays that decision on its own engine objects (a
BlockManager, a Scheduler's queues, a cache), checking the engine's invariants after every step. The
student's process never holds an engine object, so a decision can only be right or wrong, not forged.

    class MyWorld:                      # the grader's side, one per case
        def observe(self) -> dict       # what the policy sees this step: plain data
        def apply(self, decision)       # replay it on the engine's objects; raise CaseFailed if it breaks one
        def done(self) -> bool
        def verdict(self) -> str        # the end state checked: raise CaseFailed, or return a summary

    def _check_policy(fn, case):        # an Exercise's check, as for a function exercise
        return replay(fn, MyWorld(**case.inputs))

An exercise whose function writes into the caller's arrays (02, the KV-cache write) is this pattern at
its smallest: the arrays it changed come back as data and the grader copies them into its own
(remote.Submission)."""
from __future__ import annotations

from typing import Any, Callable, Protocol

from minillm.course.cases import CaseFailed


class World(Protocol):
    def observe(self) -> Any: ...
    def apply(self, decision: Any) -> None: ...
    def done(self) -> bool: ...
    def verdict(self) -> str: ...


def replay(policy: Callable, world: World, max_steps: int = 1000) -> str:
    """Step `world` with the student's `policy` until it is done: policy(observation) -> decision, then
    world.apply(decision) on the grader's objects. A broken invariant fails the case naming its step."""
    for step in range(max_steps):
        if world.done():
            return world.verdict()
        decision = policy(world.observe())
        try:
            world.apply(decision)
        except CaseFailed as e:
            raise CaseFailed(f"step {step}: {e}") from None
        except (TypeError, ValueError, KeyError, IndexError) as e:      # a decision of the wrong shape
            raise CaseFailed(f"step {step}: the decision {_clip(decision)} cannot be applied "
                             f"({type(e).__name__}: {e})") from None
    raise CaseFailed(f"not done after {max_steps} steps: the policy makes no progress")


def _clip(value, n: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= n else text[:n - 3] + "..."
