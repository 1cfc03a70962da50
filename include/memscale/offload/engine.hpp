// memscale — the tier-aware offload engine. store() moves a tensor to the first
// tier with room (CUDA tensors: pinned host, pageable host, disk; CPU tensors:
// disk), load() brings it back bit-identical on its own device. A full or
// failing tier spills to the next; when none is left the tensor stays where it
// is, so a step never fails for want of offload room.
//
// With async (Config::async_offload), device->host copies run on side streams
// ordered by events, disk writes and reads on a small I/O pool, and load()
// prefetches the groups (wrapped layers) that backward needs next. Without it
// every copy is synchronous.
//
// Ownership: hooks own the engine, records (stored_tensor) own only the shared
// core (budgets, statistics, pinned pool, disk directory). I/O jobs own records
// and the core, never the engine, so the engine (and its I/O pool) is never
// destroyed on one of its own threads. The disk directory goes with the core.
//
// The parts, bottom first:
//   engine_options.hpp    engine_options, options_from(Config), engine_stats
//   engine_core.hpp       detail::engine_core: the state records share with the engine
//   stored_tensor.hpp     stored_tensor (one stored tensor) and its batch helpers
//   engine_class.hpp      class engine: its members, the short ones defined in place
//   engine_placement.hpp  engine: placing a tensor on each tier, the async disk write
//   engine_store.hpp      engine: store(), store_or_defer(), flush() into batches
//   engine_load.hpp       engine: load(), fetch from each tier, prefetch
//   disk_rate.hpp         the disk tier's rate as measured here, for the planner
#pragma once

#include <memscale/offload/disk_rate.hpp>
#include <memscale/offload/engine_class.hpp>
#include <memscale/offload/engine_core.hpp>
#include <memscale/offload/engine_load.hpp>
#include <memscale/offload/engine_options.hpp>
#include <memscale/offload/engine_placement.hpp>
#include <memscale/offload/engine_store.hpp>
#include <memscale/offload/stored_tensor.hpp>
