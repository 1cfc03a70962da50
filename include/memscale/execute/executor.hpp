// memscale — the executor: attaches to a model, swaps technique wrappers into
// its chains' slots (or runs its call sites through them) and detaches. This
// header gathers its parts, bottom-up:
//   managed_chain.hpp          technique_set, the planning probe, managed_chain, call records
//   planning_scope.hpp         planning's thread-local state and scopes, the outside-allocator probe
//   attachment.hpp             class attachment: its members and short functions
//   attachment_levels.hpp      profile a chain; weigh nested call sites' finer level
//   attachment_planning.hpp    capture the example's inputs; profile and plan chains
//   attachment_apply.hpp       commit a plan: swap Sequential slots, call-site runners
//   attachment_call_sites.hpp  record, plan and run memscale::forward calls
//   attachment_report.hpp      technique notes, verify_correctness's step and judgement
//   attach_detach.hpp          core::attach, core::detach, attachment::restore
#pragma once

#include <memscale/execute/managed_chain.hpp>
#include <memscale/execute/planning_scope.hpp>
#include <memscale/execute/attachment.hpp>
#include <memscale/execute/attachment_levels.hpp>
#include <memscale/execute/attachment_planning.hpp>
#include <memscale/execute/attachment_apply.hpp>
#include <memscale/execute/attachment_call_sites.hpp>
#include <memscale/execute/attachment_report.hpp>
#include <memscale/execute/attach_detach.hpp>
