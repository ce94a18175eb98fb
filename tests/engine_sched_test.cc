// The scheduler's decisions (worker/engine/sched.h), one at a time, on hand-made views.
#include <gtest/gtest.h>

extern "C" {
#include "worker/engine/sched.h"
}

namespace {

sched_room Room(int slots, int pages, int running) {
    return sched_room{ .cache_bytes = 0, .cache_budget = 0, .slots_free = slots, .pages_free = pages,
                       .page_tokens = 64, .paged = true, .n_running = running };
}

TEST(EngineSched, AdmitNeedsBudgetSlotAndPages) {
    const sched_req r = { .n_feed = 100, .n_prompt = 100, .max_new_tokens = 200, .bytes_max = 1000 };
    EXPECT_EQ(sched_admit(&(const sched_room &)Room(1, 2, 3), &r, true, false), SCHED_ADMIT);  // 101 tokens: 2 pages
    EXPECT_EQ(sched_admit(&(const sched_room &)Room(1, 1, 3), &r, true, false), SCHED_WAIT);
    EXPECT_EQ(sched_admit(&(const sched_room &)Room(1, 1, 3), &r, true, true), SCHED_EVICT);
    EXPECT_EQ(sched_admit(&(const sched_room &)Room(1, 1, 0), &r, true, false), SCHED_ADMIT);  // alone: may start short
    EXPECT_EQ(sched_admit(&(const sched_room &)Room(1, 4, 3), &r, false, false), SCHED_WAIT);  // whole length: 5 pages
    EXPECT_EQ(sched_admit(&(const sched_room &)Room(1, 5, 3), &r, false, false), SCHED_ADMIT);
    EXPECT_EQ(sched_admit(&(const sched_room &)Room(0, 9, 3), &r, true, false), SCHED_WAIT);
    EXPECT_EQ(sched_admit(&(const sched_room &)Room(0, 9, 3), &r, true, true), SCHED_EVICT);
    sched_room budget = Room(1, 9, 1);
    budget.cache_budget = 1500;
    budget.cache_bytes = 600;
    EXPECT_EQ(sched_admit(&budget, &r, true, true), SCHED_WAIT);  // the byte budget is not cured by eviction
    budget.cache_bytes = 500;
    EXPECT_EQ(sched_admit(&budget, &r, true, true), SCHED_ADMIT);
    sched_room flat = Room(1, 0, 3);
    flat.paged = false;
    EXPECT_EQ(sched_admit(&flat, &r, true, false), SCHED_ADMIT);
}

TEST(EngineSched, PrefillChunkStopsAtBudgetAndBoundary) {
    EXPECT_EQ(sched_prefill_chunk(100, 0, 2048, 0), 100);
    EXPECT_EQ(sched_prefill_chunk(5000, 1000, 2048, 0), 2048);
    EXPECT_EQ(sched_prefill_chunk(300, 0, 2048, 256), 256);   // stops at the prefix to keep
    EXPECT_EQ(sched_prefill_chunk(300, 256, 2048, 256), 44);  // then goes on
    EXPECT_EQ(sched_prefix_boundary(300, 64, 0, 0), 256);
    EXPECT_EQ(sched_prefix_boundary(256, 64, 0, 0), 192);  // leaves a prompt token
    EXPECT_EQ(sched_prefix_boundary(300, 64, 256, 0), 0);  // already there (a hit)
    EXPECT_EQ(sched_prefix_boundary(300, 64, 0, 3), 0);    // resumed after a preemption
    EXPECT_EQ(sched_prefix_boundary(40, 64, 0, 0), 0);
}

TEST(EngineSched, VictimIsTheNewestAfterSelf) {
    const bool holds[5] = {true, true, false, true, false};
    EXPECT_EQ(sched_victim(holds, 5, 0), 3);
    EXPECT_EQ(sched_victim(holds, 5, 3), -1);  // an older one never gives way for a newer one
    EXPECT_EQ(sched_victim(holds, 3, 0), 1);
}

}  // namespace
