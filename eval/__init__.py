"""Acceptance jobs, speed measurement, reports and plots."""
