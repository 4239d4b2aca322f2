use super::arithmetic::{Arithmetic, ArithmeticConfig, first_integer};
use super::frozenlake::{FrozenLake, FrozenLakeConfig};
use super::sokoban::{Sokoban, SokobanConfig};
use super::tictactoe::{TicTacToe, TicTacToeConfig, opponent_move};
use super::{Dir, InvalidAction};
use crate::env::Environment;

fn block<F: Future>(f: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("runtime")
        .block_on(f)
}

#[test]
fn actions_parse_as_documented() {
    let cases = [
        ("left", Some(Dir::Left)),
        ("D", Some(Dir::Down)),
        (" right please", Some(Dir::Right)),
        ("up.", Some(Dir::Up)),
        ("jump", None),
        ("", None),
    ];
    for (text, want) in cases {
        assert_eq!(Dir::parse(text), want, "{text:?}");
    }
}

#[test]
fn frozenlake_follows_the_rules() {
    block(async {
        let mut e = FrozenLake::new(FrozenLakeConfig::default());
        let obs = e.reset(0).await.unwrap();
        assert_eq!(obs.text, "P F F F\nF H F H\nF F F H\nH F F G\n");
        // Walls hold the agent in place.
        let s = e.step("up", &Default::default()).await.unwrap();
        assert!(!s.terminated && s.observation.text.starts_with('P'));
        // down, down, right, right, down, right reaches G on the classic map.
        let mut last = None;
        for a in ["down", "down", "right", "right", "down", "right"] {
            last = Some(e.step(a, &Default::default()).await.unwrap());
        }
        let last = last.unwrap();
        assert!(last.terminated && last.success && last.reward == 1.0);
        assert!(
            e.step("down", &Default::default()).await.is_err(),
            "no step after the end"
        );
        // Right from the start then down falls into the hole at (1,1).
        e.reset(0).await.unwrap();
        e.step("right", &Default::default()).await.unwrap();
        let s = e.step("down", &Default::default()).await.unwrap();
        assert!(s.terminated && !s.success && s.reward == 0.0);
    });
}

#[test]
fn frozenlake_invalid_actions_cost_the_penalty_or_end_the_episode() {
    block(async {
        let mut e = FrozenLake::new(FrozenLakeConfig {
            invalid: InvalidAction {
                penalty: -0.5,
                end_episode: false,
            },
            ..Default::default()
        });
        e.reset(1).await.unwrap();
        let s = e.step("fly", &Default::default()).await.unwrap();
        assert!(s.invalid_action && s.reward == -0.5 && !s.terminated && !s.truncated);
        let mut e = FrozenLake::new(FrozenLakeConfig {
            invalid: InvalidAction {
                penalty: 0.0,
                end_episode: true,
            },
            ..Default::default()
        });
        e.reset(1).await.unwrap();
        let s = e
            .step("\u{0}\u{1}garbage", &Default::default())
            .await
            .unwrap();
        assert!(s.invalid_action && s.truncated);
    });
}

#[test]
fn frozenlake_seeds_fix_random_maps_and_slips() {
    block(async {
        let cfg = FrozenLakeConfig {
            size: 8,
            slippery: true,
            random_map: true,
            ..Default::default()
        };
        let run = |seed| {
            let cfg = cfg.clone();
            async move {
                let mut e = FrozenLake::new(cfg);
                let mut texts = vec![e.reset(seed).await.unwrap().text];
                for _ in 0..10 {
                    let s = e.step("right", &Default::default()).await.unwrap();
                    texts.push(s.observation.text);
                    if s.terminated {
                        break;
                    }
                }
                texts
            }
        };
        assert_eq!(run(3).await, run(3).await);
        assert_ne!(
            run(3).await[0],
            run(4).await[0],
            "another seed, another map"
        );
        assert_eq!(run(3).await[0].lines().count(), 8);
        // Slippery: the same intended move does not always go the same way.
        let mut moved = std::collections::BTreeSet::new();
        for seed in 0..30 {
            let mut e = FrozenLake::new(FrozenLakeConfig {
                slippery: true,
                ..Default::default()
            });
            e.reset(seed).await.unwrap();
            moved.insert(
                e.step("right", &Default::default())
                    .await
                    .unwrap()
                    .observation
                    .text,
            );
        }
        assert!(moved.len() >= 2, "slippery ice never slipped");
    });
}

#[test]
fn sokoban_rooms_are_solvable_and_pushing_works() {
    block(async {
        for boxes in [1, 2] {
            for seed in 0..20 {
                let mut e = Sokoban::new(SokobanConfig {
                    boxes,
                    ..Default::default()
                });
                let text = e.reset(seed).await.unwrap().text;
                assert_eq!(text.matches(['$', '*']).count(), boxes, "{text}");
                assert_eq!(text.matches(['.', '*', '+']).count(), boxes, "{text}");
                assert_eq!(text.matches(['@', '+']).count(), 1, "{text}");
                // Solvable: a breadth-first search over moves finds the solution.
                assert!(
                    solve(
                        SokobanConfig {
                            boxes,
                            ..Default::default()
                        },
                        seed
                    )
                    .await,
                    "seed {seed} with {boxes} boxes is unsolvable:\n{text}"
                );
            }
        }
        let mut e = Sokoban::new(SokobanConfig::default());
        e.reset(0).await.unwrap();
        let s = e.step("sideways", &Default::default()).await.unwrap();
        assert!(s.invalid_action && s.reward < 0.0);
    });
}

/// Breadth-first search over action sequences on the rendered state.
async fn solve(cfg: SokobanConfig, seed: u64) -> bool {
    use std::collections::{HashSet, VecDeque};
    let start = {
        let mut e = Sokoban::new(cfg.clone());
        e.reset(seed).await.unwrap().text
    };
    let mut seen = HashSet::from([start.clone()]);
    let mut q = VecDeque::from([Vec::<&str>::new()]);
    while let Some(path) = q.pop_front() {
        if path.len() > 30 {
            continue;
        }
        for a in ["left", "down", "right", "up"] {
            let mut e = Sokoban::new(cfg.clone());
            e.reset(seed).await.unwrap();
            let mut last = None;
            for p in path.iter().chain(std::iter::once(&a)) {
                last = Some(e.step(p, &Default::default()).await.unwrap());
            }
            let s = last.unwrap();
            if s.success {
                return true;
            }
            if seen.insert(s.observation.text) {
                let mut next = path.clone();
                next.push(a);
                q.push_back(next);
            }
        }
        if seen.len() > 20_000 {
            return false;
        }
    }
    false
}

#[test]
fn arithmetic_checks_the_answer() {
    block(async {
        let mut e = Arithmetic::new(ArithmeticConfig {
            max_operand: 20,
            ops: vec!['+', '-', '*'],
        });
        let q = e.reset(5).await.unwrap().text;
        let ans = e.answer();
        assert!(q.ends_with('='));
        let s = e
            .step(&format!(" {ans} "), &Default::default())
            .await
            .unwrap();
        assert!(s.success && s.terminated && s.reward == 1.0);
        e.reset(5).await.unwrap();
        let s = e
            .step(&format!("{}", ans + 1), &Default::default())
            .await
            .unwrap();
        assert!(!s.success && s.reward == 0.0 && !s.invalid_action);
        e.reset(5).await.unwrap();
        assert!(
            e.step("no idea", &Default::default())
                .await
                .unwrap()
                .invalid_action
        );
    });
    for (text, want) in [
        ("12", Some(12)),
        ("x = -3", Some(-3)),
        ("\\boxed{7}", Some(7)),
        ("a-b", None),
        ("", None),
    ] {
        assert_eq!(first_integer(text), want, "{text:?}");
    }
}

#[test]
fn tictactoe_opponent_wins_blocks_and_takes_the_centre() {
    let b = |s: &str| -> [u8; 9] { s.as_bytes().try_into().unwrap() };
    assert_eq!(
        opponent_move(&b("OO.XX...."), b'O', b'X'),
        Some(2),
        "win first"
    );
    assert_eq!(
        opponent_move(&b("XX.O....."), b'O', b'X'),
        Some(2),
        "then block"
    );
    assert_eq!(
        opponent_move(&b("X........"), b'O', b'X'),
        Some(4),
        "then the centre"
    );
    block(async {
        let mut e = TicTacToe::new(TicTacToeConfig::default());
        e.reset(0).await.unwrap();
        let s = e.step("5", &Default::default()).await.unwrap();
        assert_eq!(s.observation.text, "O . .\n. X .\n. . .\n");
        let s = e.step("5", &Default::default()).await.unwrap();
        assert!(s.invalid_action, "an occupied cell is invalid");
        // X plays 3 and 7: O must block at 7 first.
        let s = e.step("3", &Default::default()).await.unwrap();
        assert!(!s.terminated, "{}", s.observation.text);
        assert_eq!(
            s.observation.text, "O . X\n. X .\nO . .\n",
            "O blocks the diagonal at cell 7"
        );
    });
}
