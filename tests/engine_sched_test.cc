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

// Step pacing: a model of steps timed at base 10 ms + 0.02 ms a prompt token; the budget it
// gives for a 20 ms target is the 500 tokens that fill the other 10 ms.
TEST(EngineSched, PaceFitsTheTargetFromMeasuredSteps) {
    sched_pace p;
    sched_pace_init(&p);
    EXPECT_EQ(sched_pace_budget(&p, 20, 8, 64, 2048), 2048);  // nothing measured: the cap
    for (int i = 0; i < 40; i++) {
        sched_pace_note(&p, 10.0, 0, 8);                  // decode only
        const int k = 300 + 50 * (i % 5);                 // steps of several chunk sizes
        sched_pace_note(&p, 10.0 + 0.02 * k, k, 8);
    }
    EXPECT_NEAR(p.base_ms, 10.0, 1e-9);
    EXPECT_NEAR(p.per_token_ms, 0.02, 1e-9);
    EXPECT_NEAR(sched_pace_budget(&p, 20, 8, 64, 2048), 500, 1);
    EXPECT_EQ(sched_pace_budget(&p, 20, 8, 64, 256), 256);   // the cap bounds it
    EXPECT_EQ(sched_pace_budget(&p, 9, 8, 64, 2048), 64);    // decode alone fills it: the floor
    EXPECT_EQ(sched_pace_budget(&p, 20, 0, 64, 2048), 2048); // no decode rows wait: the cap
    EXPECT_EQ(sched_pace_budget(&p, 0, 8, 64, 2048), 2048);  // no target: the cap
    EXPECT_EQ(sched_pace_budget(&p, 9, 8, 64, 32), 32);      // a floor above the cap is the cap

    // the batch doubles (steps of 20 ms with no prompt work): the budget follows within a few steps
    for (int i = 0; i < 30; i++) sched_pace_note(&p, 20.0, 0, 16);
    EXPECT_EQ(sched_pace_budget(&p, 20, 16, 64, 2048), 64);
    for (int i = 0; i < 60; i++) sched_pace_note(&p, 15.0, 0, 12);
    EXPECT_NEAR(sched_pace_budget(&p, 20, 12, 64, 2048), 250, 2);
}

// Steps whose prompt work costs a fixed 6 ms (the experts a pass reads) plus 0.005 ms a token:
// the fit tells the two apart, so a 20 ms target over a 10 ms decode gets the 800 tokens that
// fit, where charging the whole cost to the tokens of 100-token chunks would give 100 or so.
TEST(EngineSched, PaceSeparatesAChunksFixedCostFromItsTokens) {
    sched_pace p;
    sched_pace_init(&p);
    for (int i = 0; i < 60; i++) {
        sched_pace_note(&p, 10.0, 0, 64);
        const int k = 64 + 40 * (i % 4);                  // the small chunks a tight target takes
        sched_pace_note(&p, 10.0 + 6.0 + 0.005 * k, k, 64);
    }
    EXPECT_NEAR(p.chunk_ms, 6.0, 1e-6);
    EXPECT_NEAR(p.per_token_ms, 0.005, 1e-9);
    EXPECT_NEAR(sched_pace_budget(&p, 20, 64, 64, 2048), 800, 1);
    EXPECT_EQ(sched_pace_budget(&p, 15, 64, 64, 2048), 64);  // the fixed cost alone overruns: the floor
    EXPECT_TRUE(sched_deadline_hopeless(&p, 1000, 10.5));    // 6 + 5 ms
    EXPECT_FALSE(sched_deadline_hopeless(&p, 1000, 11.5));
    // steps of one size cannot show a fixed cost: they are charged per token, as before
    sched_pace q;
    sched_pace_init(&q);
    sched_pace_note(&q, 10.0, 0, 8);
    for (int i = 0; i < 10; i++) sched_pace_note(&q, 20.0, 500, 8);
    EXPECT_NEAR(q.per_token_ms, 0.02, 1e-9);
    EXPECT_EQ(q.chunk_ms, 0.0);
}

// A mixed step's prompt tokens end its rows on a pass boundary when that leaves the floor.
TEST(EngineSched, MixedBudgetEndsOnAPass) {
    EXPECT_EQ(sched_mixed_budget(2048, 64, 2048, 64), 1984);  // one pass, not two
    EXPECT_EQ(sched_mixed_budget(2048, 64, 256, 64), 1984);   // eight passes, not nine
    EXPECT_EQ(sched_mixed_budget(2048, 0, 256, 64), 2048);    // already whole
    EXPECT_EQ(sched_mixed_budget(100, 64, 2048, 64), 100);    // one pass either way
    EXPECT_EQ(sched_mixed_budget(2048, 2000, 2048, 64), 2048); // the cut would leave 48 < floor
    EXPECT_EQ(sched_mixed_budget(512, 10, 0, 64), 512);       // no pass size known
}

// Prefill coalescing holds prompt work only under saturation, while the ready tokens are few,
// and for at most the hold time.
TEST(EngineSched, HoldPrefillOnlyWhenSaturatedShortAndRecent) {
    // hold_ms, held_ms, rows, waiting, places, ready, budget
    EXPECT_TRUE(sched_hold_prefill(20, 0, 60, 30, 1, 300, 2048));
    EXPECT_TRUE(sched_hold_prefill(20, 19.9, 60, 30, 1, 1023, 2048));
    EXPECT_FALSE(sched_hold_prefill(20, 20, 60, 30, 1, 300, 2048));    // held long enough
    EXPECT_FALSE(sched_hold_prefill(20, 0, 60, 30, 3, 1024, 2048));    // half a budget is ready
    EXPECT_FALSE(sched_hold_prefill(20, 0, 60, 3, 3, 300, 2048));      // every waiting one has a place
    EXPECT_FALSE(sched_hold_prefill(20, 0, 0, 30, 1, 300, 2048));      // no decode rows to serve
    EXPECT_FALSE(sched_hold_prefill(0, 0, 60, 30, 1, 300, 2048));      // off
    EXPECT_FALSE(sched_hold_prefill(20, 0, 60, 30, 0, 0, 2048));       // no place to admit into
}

TEST(EngineSched, DeadlineHopelessOnlyWhenMeasuredAndTooNear) {
    sched_pace p;
    sched_pace_init(&p);
    EXPECT_FALSE(sched_deadline_hopeless(&p, 100000, 1.0));  // nothing measured
    sched_pace_note(&p, 20.0, 500, 8);                        // before a base: not charged
    EXPECT_FALSE(sched_deadline_hopeless(&p, 100000, 1.0));
    sched_pace_note(&p, 10.0, 0, 8);                          // a decode step: base 10 ms
    sched_pace_note(&p, 20.0, 500, 8);                        // 0.02 ms a prompt token
    EXPECT_TRUE(sched_deadline_hopeless(&p, 1000, 19.0));
    EXPECT_FALSE(sched_deadline_hopeless(&p, 1000, 21.0));
    EXPECT_FALSE(sched_deadline_hopeless(&p, 0, 0.0));        // nothing to prefill
}

}  // namespace
