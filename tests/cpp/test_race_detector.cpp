// The race detector's rules, access by access: which pairs race, which
// barriers order them, and what it remembers.
#include <gtest/gtest.h>

#include <optional>
#include <vector>

#include "race_detector.hpp"

namespace {

using mfa::cpu::RaceDetector;

class RaceDetectorTest : public ::testing::Test {
 protected:
  RaceDetectorTest() : simdgroups_(2) { detector_.begin_group(simdgroups_.data(), 64); }

  std::optional<RaceDetector::Race> read(std::uint32_t thread, int line, std::size_t offset = 0,
                                         std::size_t bytes = 4) {
    return detector_.access(offset, bytes, true, false, thread, "k.metal", line);
  }
  std::optional<RaceDetector::Race> write(std::uint32_t thread, int line, std::size_t offset = 0,
                                          std::size_t bytes = 4) {
    return detector_.access(offset, bytes, false, true, thread, "k.metal", line);
  }
  void simdgroup_barrier(std::uint32_t simdgroup) { ++simdgroups_[simdgroup].ordering_barriers; }

  std::vector<mfa_abi::SimdGroup> simdgroups_;
  RaceDetector detector_;
};

TEST_F(RaceDetectorTest, ReadAfterWriteNamesBothAccesses) {
  EXPECT_FALSE(write(3, 10, 4));
  const auto race = read(40, 12, 6, 4);
  ASSERT_TRUE(race);
  EXPECT_EQ(race->offset, 6u);  // the first byte both touch
  EXPECT_EQ(race->earlier.thread, 3u);
  EXPECT_EQ(race->earlier.line, 10);
  EXPECT_TRUE(race->earlier.writes);
  EXPECT_EQ(race->later.thread, 40u);
  EXPECT_EQ(race->later.line, 12);
  EXPECT_FALSE(race->later.writes);
}

TEST_F(RaceDetectorTest, WriteAfterReadAndWriteAfterWrite) {
  EXPECT_FALSE(read(1, 5));
  const auto after_read = write(2, 6);
  ASSERT_TRUE(after_read);
  EXPECT_FALSE(after_read->earlier.writes);
  EXPECT_EQ(after_read->earlier.thread, 1u);

  detector_.threadgroup_barrier();
  EXPECT_FALSE(write(1, 7));
  const auto after_write = write(2, 8, 2, 1);
  ASSERT_TRUE(after_write);
  EXPECT_TRUE(after_write->earlier.writes && after_write->later.writes);
}

TEST_F(RaceDetectorTest, OneThreadNeverRacesItselfNorDisjointBytes) {
  EXPECT_FALSE(write(7, 1));
  EXPECT_FALSE(read(7, 2));
  EXPECT_FALSE(write(7, 3));
  EXPECT_FALSE(write(8, 4, 4));
  EXPECT_FALSE(read(9, 5, 8));
}

TEST_F(RaceDetectorTest, ManyReadersWithoutAWriterAreFine) {
  for (std::uint32_t thread = 0; thread < 64; ++thread) EXPECT_FALSE(read(thread, 1));
  EXPECT_TRUE(write(63, 2));  // but then any writer races one of them
}

TEST_F(RaceDetectorTest, AThreadgroupBarrierOrdersEverything) {
  EXPECT_FALSE(write(0, 1));
  EXPECT_FALSE(read(33, 1, 4));
  detector_.threadgroup_barrier();
  EXPECT_FALSE(read(1, 2));
  EXPECT_FALSE(write(2, 3, 4));
}

TEST_F(RaceDetectorTest, ASimdgroupBarrierOrdersOnlyItsOwnLanes) {
  EXPECT_FALSE(write(0, 1));
  simdgroup_barrier(0);
  EXPECT_FALSE(read(31, 2));  // lanes of simdgroup 0: ordered
  const auto race = read(32, 3);  // simdgroup 1: not
  ASSERT_TRUE(race);
  EXPECT_EQ(race->earlier.thread, 0u);
}

TEST_F(RaceDetectorTest, AReaderOrderedBeforeANewOneMakesRoomForIt) {
  EXPECT_FALSE(read(0, 1));
  EXPECT_FALSE(read(1, 1));
  simdgroup_barrier(0);
  EXPECT_FALSE(read(2, 2));  // takes the slot of a reader of simdgroup 0
  simdgroup_barrier(0);
  const auto race = write(40, 3);
  ASSERT_TRUE(race);
  EXPECT_LT(race->earlier.thread, 3u);
}

TEST_F(RaceDetectorTest, ANewGroupForgetsTheLastOne) {
  EXPECT_FALSE(write(0, 1));
  detector_.begin_group(simdgroups_.data(), 64);
  EXPECT_FALSE(write(1, 2));
}

}  // namespace
