"""prompts → target-generated conversations → tokenised + loss masks → target features."""
