// The timed-event contract (Device::create_timed_event, elapsed_ms), checked the same way on
// every backend (tests include from the repository root).
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include "strata/device.h"

namespace strata::test {

// Two timed events around a host function that sleeps `ms` on the compute stream measure at
// least that much (a lower bound: the stream cannot reach the second record sooner), and the
// reverse order the same time negative; an event that was never recorded is refused.
inline void expect_timed_events_measure_the_stream(Device& dev, int ms = 20) {
  auto a = dev.create_timed_event();
  auto b = dev.create_timed_event();
  auto never = dev.create_timed_event();
  Stream& s = dev.compute_stream();
  dev.record(*a, s);
  dev.host_fn(s, [ms] { std::this_thread::sleep_for(std::chrono::milliseconds(ms)); });
  dev.record(*b, s);
  ASSERT_TRUE(dev.synchronize(*b).is_ok());
  auto t = dev.elapsed_ms(*a, *b);
  ASSERT_TRUE(t.is_ok()) << t.status().to_string();
  EXPECT_GE(*t, ms * 0.999) << dev.name();
  auto back = dev.elapsed_ms(*b, *a);
  ASSERT_TRUE(back.is_ok()) << back.status().to_string();
  EXPECT_DOUBLE_EQ(*back, -*t);
  EXPECT_FALSE(dev.elapsed_ms(*a, *never).is_ok()) << dev.name();
}

}  // namespace strata::test
