"""The grid barrier of the persistent decode kernel (``decode_kernels.persistent_decode_kernel``).

``grid_barrier(count_ptr, num_programs)``: every program of a cooperative grid (all resident at
once, so a spinning program cannot keep one that must arrive from running) adds one to an int32
counter with release semantics and polls it with acquire semantics until all have arrived; a CTA
barrier on each side makes the other threads' writes part of the release and orders their reads
after the acquire. Writes made before the barrier by any program are visible to every program
after it. The counter must be zero at the launch and serves once: the call zeroes it together
with the tile counters it zeroes anyway (``launch.run_persistent``), so the barrier costs one
atomic add per program and the polling.

Why the low-latency EP kernels (``moekit.ep.lowlatency.cuda``) keep their own. Their barrier has
the same memory semantics (GPU scope, release on arrival, acquire on leaving, one GPU's
cooperative grid; the cross-GPU signalling there is separate, at system scope), but a different
state contract: it lives in a state buffer that persists across steps and is never zeroed (a
zeroing launch per step is what that kernel avoids), serves several times, in grids whose size
changes with the batch and in CUDA-graph replays, so it is sense-reversing: the last program to
arrive resets the count and bumps a generation word that the others poll. This one-shot counter
would need a zeroed word per use there, and the generation barrier here would add a generation
word to the decode kernel's sync layout, a load before arriving and a reset by the last program
(a change of timing to measure on the GPU first). So the two stay separate, each with the state
contract its caller has.
"""

from __future__ import annotations

from moekit.kernels.backend import HAVE_TRITON, tl, triton

if HAVE_TRITON:

    @triton.jit
    def grid_barrier(count_ptr, num_programs):
        """Wait until every program of the grid has arrived (a cooperative launch keeps them
        all resident, so the spin cannot starve a program that has not started). Writes made
        before the barrier by any program are visible after it: release on arrival, acquire
        while polling, and a CTA barrier on each side for the other threads."""
        tl.debug_barrier()
        seen = tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu") + 1
        while seen < num_programs:
            seen = tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu")
        tl.debug_barrier()
