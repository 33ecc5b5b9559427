# The tier manager's parts (src/tiers/), each tested alone against its header's contract, one
# binary per part (tests/tiers/); the manager as a whole: tier.cmake.
set(strata_tier_parts
    trace cache_policy placement memory_model homes device_cache activation_stash grad_buckets
    grad_spill optimizer_pipeline delayed_update speculation stream_stamps)
foreach(part ${strata_tier_parts})
  strata_test(${part}_test ${CMAKE_CURRENT_LIST_DIR}/tiers/${part}_test.cc)
endforeach()
