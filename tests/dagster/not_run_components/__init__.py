"""A Components code location for test_not_run_locations: the joblease resource component (declared with
its defaults, so with the not-run sensors) and two jobs whose leased step may not run in a re-execution.
No sensor is declared by hand."""
