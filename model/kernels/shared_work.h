// The helper thread that shares a large decode step's attention (decode_step.cpp), and the
// protocol by which the two threads split pieces of work without the decode thread ever waiting.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include <sched.h>

#include "simd.h"

namespace shared_work {

// A large step's attention shared with a helper thread.
//
// One engine thread decodes; on a two-core machine the other core runs the HTTP side and the
// clients, and has time to spare. torch's threads split work statically and wait for the
// slowest, so a thread that has lost its core to another process holds up the whole step (the
// server got nothing from `--threads 2`). The helper is one
// thread that takes rows of each block's attention from the same counter as the decode thread,
// which never waits for it: a row the helper has taken and not finished when the decode thread
// runs out of rows, the decode thread computes itself. The same code on the same inputs gives
// the same bits on either thread, so no number depends on who computed it.
//
// Only the attention: at 32 rows it streams each row's whole cache from L3, where two cores
// draw about twice the bandwidth of one, while the projections are compute-bound on one core
// (and on the tile unit, where there is one, no faster on two). So from 16 rows the batch goes
// in two groups, staggered through the blocks, and the helper attends one group while this
// thread projects the other (decode_step.cpp's through_blocks_shared). The measurements behind
// this design are in docs/performance-log.md (the eleventh round).
//
// A piece of work owns (or holds a reference to) everything the helper reads, so a helper still
// busy with a piece of finished work reads live memory; its result is dropped.
class SharedWork {
 public:
  enum State : int { kOpen = 0, kHelperDone = 1, kTaken = 2 };
  // How the two threads meet: freely (serving), or, for the tests, in an order that takes one
  // path for sure — the helper takes the first piece and finishes it while the decode thread
  // waits, or takes it and stalls until the decode thread has taken it back to compute itself
  // (a fixed stall was not enough on a busy machine, where the decode thread may wait longer
  // for its core).
  enum Order : int { kFree = 0, kHelperFinishes = 1, kHelperStalls = 2 };
  struct Outcome {
    int64_t helped = 0;  // pieces the helper's results supplied
    int64_t taken = 0;   // pieces the helper took and the decode thread computed
  };

  virtual ~SharedWork() = default;
  int64_t pieces() const { return pieces_; }
  bool exhausted() const { return next_.load(std::memory_order_relaxed) >= pieces_; }

  // Ready for `pieces` pieces (work objects are reused, step after step).
  void reset(int64_t pieces) {
    pieces_ = pieces;
    next_.store(0, std::memory_order_relaxed);
    if (static_cast<int64_t>(states_.size()) < pieces) states_ = std::vector<Slot>(pieces);
    for (int64_t i = 0; i < pieces; ++i) states_[i].state.store(kOpen, std::memory_order_relaxed);
  }

  // The helper's turn: pieces into its own buffer until none is left.
  void help(Order order) {
    prepare_helper();
    for (int64_t i; (i = next_.fetch_add(1)) < pieces_;) {
      if (order == kHelperStalls) wait_for([&] { return states_[i].state.load() != kOpen; });
      try {
        compute(i, true);
      } catch (...) {  // the piece stays open: the decode thread computes it, and raises there
        return;
      }
      int open = kOpen;
      states_[i].state.compare_exchange_strong(open, kHelperDone, std::memory_order_release,
                                               std::memory_order_relaxed);
    }
  }

  // The decode thread's turn: pieces into place until none is left; then each piece the helper
  // took, its result copied into place if it is done, else computed here.
  Outcome run(Order order) {
    if (order != kFree) wait_for([this] { return next_.load() > 0; });  // the helper's first
    mine_.assign(pieces_, 0);
    for (int64_t i; (i = next_.fetch_add(1)) < pieces_;) {
      compute(i, false);
      mine_[i] = 1;
    }
    Outcome outcome;
    for (int64_t i = 0; i < pieces_; ++i) {
      if (mine_[i]) continue;
      if (order == kHelperFinishes) wait_for([&] { return states_[i].state.load() != kOpen; });
      int open = kOpen;
      if (states_[i].state.compare_exchange_strong(open, kTaken, std::memory_order_acquire)) {
        compute(i, false);  // the helper has not finished it, and will not be asked for it
        ++outcome.taken;
      } else {
        publish(i);  // kHelperDone: its buffer holds the piece
        ++outcome.helped;
      }
    }
    return outcome;
  }

 protected:
  // Piece i into its place (by_helper false) or into the helper's own buffer.
  virtual void compute(int64_t i, bool by_helper) = 0;
  // The helper's result for piece i copied into place.
  virtual void publish(int64_t i) = 0;
  // Called on the helper before its first piece of this work.
  virtual void prepare_helper() {}

  // The tests' orders: spin until `done` (at most a second: a helper that never comes must not
  // hang them; they then fail on the outcome).
  template <typename Done>
  static void wait_for(Done done) {
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(1);
    while (!done() && std::chrono::steady_clock::now() < give_up) simd::pause();
  }

 private:
  struct alignas(64) Slot {  // one cache line each: the two threads write neighbours
    std::atomic<int> state{kOpen};
  };
  int64_t pieces_ = 0;
  std::atomic<int64_t> next_{0};
  std::vector<Slot> states_;
  std::vector<char> mine_;
};

// The helper thread: it sleeps until a step with shared work begins, then waits awake (a wake-up
// takes longer than a block's attention) for each piece of work the step posts, until the step
// ends.
class Helper {
 public:
  static Helper& instance() {
    static Helper* helper = new Helper();  // never destroyed: its thread sleeps until the
    return *helper;                        // process ends
  }

  void begin_step() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      awake_.store(true, std::memory_order_relaxed);
    }
    wake_.notify_one();
  }

  void end_step() {
    std::lock_guard<std::mutex> lock(mutex_);
    awake_.store(false, std::memory_order_relaxed);
    posted_work_.clear();  // anything a step that raised did not take back
  }

  // `work` may run on the helper from now until take_back; works are helped in posting order.
  void post(const std::shared_ptr<SharedWork>& work, SharedWork::Order order) {
    std::lock_guard<std::mutex> lock(mutex_);
    posted_work_.push_back(work);
    order_ = order;
    posted_.fetch_add(1, std::memory_order_release);
  }

  // `work` run to its end on the calling thread (with the helper until it runs out of pieces),
  // then out of the helper's reach.
  SharedWork::Outcome take_back(const std::shared_ptr<SharedWork>& work,
                                SharedWork::Order order) {
    const SharedWork::Outcome outcome = work->run(order);
    std::lock_guard<std::mutex> lock(mutex_);
    posted_work_.erase(std::remove(posted_work_.begin(), posted_work_.end(), work),
                       posted_work_.end());
    return outcome;
  }

 private:
  Helper() { std::thread([this] { serve(); }).detach(); }

  // The first posted work with pieces left (null: none), and the order the threads meet in.
  std::pair<std::shared_ptr<SharedWork>, SharedWork::Order> next_work() {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& work : posted_work_)
      if (!work->exhausted()) return {work, order_};
    return {nullptr, order_};
  }

  void serve() {
    int64_t seen = 0;
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [this] { return awake_.load(std::memory_order_relaxed); });
      }
      for (int spins = 0;; ++spins) {
        if (posted_.load(std::memory_order_acquire) != seen) {
          seen = posted_.load(std::memory_order_relaxed);
          // Every posted work with pieces left, in order (a reference holds each one's memory
          // while it runs here).
          for (auto [work, order] = next_work(); work; std::tie(work, order) = next_work())
            work->help(order);
          spins = 0;
          continue;
        }
        if (!awake_.load(std::memory_order_relaxed)) break;
        // Now and then the core to any other thread that wants it (never holding the lock:
        // the decode thread would wait for it).
        if (spins % 64 == 63) sched_yield();
        simd::pause();
      }
    }
  }

  std::mutex mutex_;
  std::condition_variable wake_;
  std::vector<std::shared_ptr<SharedWork>> posted_work_;  // posted, not yet taken back
  SharedWork::Order order_ = SharedWork::kFree;
  std::atomic<int64_t> posted_{0};
  std::atomic<bool> awake_{false};
};

// The helper awake for this object's lifetime, when `wanted` (a step that throws ends too).
class Awake {
 public:
  explicit Awake(bool wanted) : wanted_(wanted) {
    if (wanted_) Helper::instance().begin_step();
  }
  ~Awake() {
    if (wanted_) Helper::instance().end_step();
  }
  Awake(const Awake&) = delete;
  Awake& operator=(const Awake&) = delete;

 private:
  bool wanted_;
};

}  // namespace shared_work
