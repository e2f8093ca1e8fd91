// How fast the fiber switch in use is, for the benchmark table.
#include <algorithm>
#include <chrono>

#include "executor.hpp"
#include "fiber.hpp"

namespace mfa::cpu {
namespace {

struct PingPong {
  FiberContext caller;
  FiberContext fiber;
};

void bounce_back_forever(void* argument) {
  auto& ping_pong = *static_cast<PingPong*>(argument);
  for (;;) switch_fiber(ping_pong.fiber, ping_pong.caller);
}

}  // namespace

double measure_context_switches_per_second(std::size_t switches) {
  const std::size_t round_trips = std::max<std::size_t>(switches / 2, 1);
  FiberStack stack(64 * 1024);
  PingPong ping_pong;
  prepare_fiber(ping_pong.fiber, stack, &bounce_back_forever, &ping_pong);
  switch_fiber(ping_pong.caller, ping_pong.fiber);  // warm up: the first switch starts the fiber
  const auto start = std::chrono::steady_clock::now();
  for (std::size_t i = 0; i < round_trips; ++i) switch_fiber(ping_pong.caller, ping_pong.fiber);
  const std::chrono::duration<double> elapsed = std::chrono::steady_clock::now() - start;
  // The fiber is left suspended in its loop: nothing on its stack owns anything.
  return 2.0 * double(round_trips) / elapsed.count();
}

}  // namespace mfa::cpu
