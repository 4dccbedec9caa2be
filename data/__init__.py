"""Prompts → target-generated conversations → tokenised + loss masks → cached target features (the data job); offline assets."""
