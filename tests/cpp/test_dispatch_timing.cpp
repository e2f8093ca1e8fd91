#include <gtest/gtest.h>

#include <optional>
#include <thread>

#include "mfa/dispatch_timing.hpp"

TEST(DispatchTiming, RequestedWhileAnyRequestLives) {
  EXPECT_FALSE(mfa::DispatchTiming::requested());
  std::optional<mfa::DispatchTiming> outer;
  outer.emplace();
  EXPECT_TRUE(mfa::DispatchTiming::requested());
  {
    mfa::DispatchTiming inner;
    EXPECT_TRUE(mfa::DispatchTiming::requested());
  }
  EXPECT_TRUE(mfa::DispatchTiming::requested());  // the outer request still lives
  outer.reset();
  EXPECT_FALSE(mfa::DispatchTiming::requested());
}

TEST(DispatchTiming, ARequestInAnotherThreadCounts) {
  std::optional<mfa::DispatchTiming> request;
  std::thread([&] { request.emplace(); }).join();
  EXPECT_TRUE(mfa::DispatchTiming::requested());
  std::thread([&] { request.reset(); }).join();
  EXPECT_FALSE(mfa::DispatchTiming::requested());
}
