use super::random_policy_success;

#[test]
fn random_policy_rates_are_measured_on_the_games_even_inside_a_runtime() {
    let task = |env: &str, alphabet: &str, turns: u32| {
        let t = format!(
            "domain = \"t\"\nmax_turns = {turns}\nmax_tokens_per_turn = 1\naction_alphabet = \"{alphabet}\"\nenv = {env}\n"
        );
        toml::from_str::<crate::spec::TaskSpec>(&t).unwrap()
    };
    // Called from inside a runtime, as `rollarc run` does.
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let (lake, sum, sim) = rt.block_on(async {
        (
            random_policy_success(
                &task(
                    "{ kind = \"frozenlake\", size = 4, end_on_invalid = true }",
                    "LDRU",
                    8,
                ),
                4000,
                1,
            ),
            random_policy_success(
                &task(
                    "{ kind = \"arithmetic\", max_operand = 4, ops = \"+\" }",
                    "0123456789",
                    1,
                ),
                4000,
                1,
            ),
            random_policy_success(&task("{ kind = \"sim\" }", "ab", 1), 10, 1),
        )
    });
    // FrozenLake 4×4: a random walk of 8 moves rarely reaches the goal; a sum of two digits
    // 0..=4 is one of 9 answers, a random digit one of 10.
    let (lake, sum) = (lake.unwrap(), sum.unwrap());
    assert!(lake < 0.05, "{lake}");
    assert!((0.07..=0.13).contains(&sum), "{sum}");
    assert_eq!(
        sim, None,
        "simulated environments have no random-policy rate"
    );
}
