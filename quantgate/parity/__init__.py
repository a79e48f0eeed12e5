"""Engine parity: is the served engine computing the same model as transformers?"""
