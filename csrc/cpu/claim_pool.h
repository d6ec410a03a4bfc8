// Work split over threads by claims, for kernels whose calls are short (a decode step's quantized projection:
// 0.1-2 ms). at::parallel_for (OpenMP) gives each thread a fixed share and ends at a barrier that every thread of the
// team must reach: on a machine with more runnable threads than cores, one of them not scheduled for a time slice
// holds the call for that slice (measured on the 2-core development VM under load: a 0.3 ms projection took 6-9 ms
// at 2 threads). Here the calling thread and the pool's workers claim units from a shared counter; the caller never
// waits for a worker that has not claimed a unit (a worker that wakes late finds nothing left), only for units in
// progress. The result never depends on which thread ran a unit: each unit writes outputs of its own.
#pragma once

#include <cstdint>
#include <functional>

namespace hebrus {

// fn(begin, end) over [0, count) in units of `grain` (the last one shorter), on up to at::get_num_threads()
// threads (the caller and sleeping workers, started on first use). Serial (one call fn(0, count)) when there is one
// unit, one thread, or the caller is itself inside a parallel region (ATen's or a pool unit). The first exception a
// unit throws is rethrown here after every claimed unit has finished.
void claim_parallel_for(int64_t count, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);

}  // namespace hebrus
