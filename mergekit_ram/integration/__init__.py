"""mergekit-facing code: method specs, registration, planner hook, publishing."""
