"""Helpers shared by the test suites (`tests.support.<module>`)."""
