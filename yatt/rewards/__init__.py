"""Rewards: rule verifiers picked by each row's data_source (GenRM judges join in yatt.genrm)."""
