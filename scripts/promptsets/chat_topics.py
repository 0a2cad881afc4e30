"""Conversations for the "chat" kind, written for kvtool: everyday and technical topics.

Each topic is a list of (user, assistant) exchanges and a few possible last user messages that the
model must answer. `{slot}` fields are filled from the topic's `slots` by the generator's seeded
draw, so the numbers and names in a chat vary with the seed. Evaluation and calibration topics are
different conversations.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Topic:
    name: str
    pairs: tuple[tuple[str, str], ...]
    finals: tuple[str, ...]
    slots: dict = field(default_factory=dict)


EVALUATION_TOPICS = (
    Topic(
        "trip to Lisbon",
        (
            ("I'm going to Lisbon for {days} days in {month} with a budget of about {budget} euros, not counting flights. "
             "Is that realistic?",
             "It is realistic if you are a little careful. A bed in a good hostel or a simple guesthouse runs about 30 to "
             "60 euros a night, a lunch menu (\"prato do dia\") in a neighbourhood tasca is often 9 to 13 euros, and a "
             "24-hour public transport pass is around 7 euros. Museums are mostly 5 to 15 euros. The things that blow "
             "budgets are taxis up the hills at night and restaurants on the main tourist streets, so plan around those."),
            ("Where should I stay? I've heard Alfama is nice but hilly.",
             "Alfama is beautiful and atmospheric, but the streets are steep, cobbled and slippery, which matters if you "
             "carry luggage. Baixa and Chiado are central, flat-ish and well connected, though pricier. Graça and "
             "Arroios are cheaper and more local, with good tram and metro links. If you want nightlife, Bairro Alto is "
             "lively, but it is loud until late. For a first visit I would pick Baixa or Arroios."),
            ("Is the famous tram 28 worth it?",
             "It is fun, but go early. The old yellow tram winds through Graça, Alfama and Estrela, and by late morning "
             "the queue at Martim Moniz can be an hour long and the cars are packed, which also makes them a favourite "
             "spot for pickpockets. Board before 9 a.m. or ride the route in the evening. Your transport pass covers it, "
             "so you do not need to buy the expensive ticket on board."),
            ("What day trips would you suggest?",
             "Sintra is the classic one: palaces and gardens in the hills, 40 minutes by train from Rossio station. Go "
             "on a weekday and book the Pena Palace ticket online. Cascais is an easy beach town on the coast line from "
             "Cais do Sodré. If you have a spare day, Setúbal and the Arrábida beaches across the river are lovely, "
             "though easier with a car or a tour."),
            ("And food? I don't eat meat but I eat fish.",
             "You are in luck: Lisbon is a great fish city. Try grilled sardines if you are there in summer, bacalhau "
             "(salt cod) in one of its many forms, and arroz de marisco, a soupy seafood rice. Pastéis de nata are a "
             "must; the ones in Belém are famous, but many bakeries make excellent ones. Ask for the \"couvert\" to be "
             "taken away if you do not want it, because the bread and olives put on the table are charged."),
            ("How do I get from the airport to the centre cheaply?",
             "The metro red line starts at the airport and reaches the centre in about 20 to 25 minutes with one "
             "change. Buy a reusable Viva Viagem card at the machines and load it with single trips or with \"zapping\" "
             "credit. The Aerobus is more convenient with luggage but costs more. A ride-hailing car is usually 12 to 18 "
             "euros, depending on traffic."),
        ),
        ("Can you put all of this into a day-by-day plan for my {days} days, with a rough daily budget?",
         "Given everything we discussed, what would you cut if my budget turned out to be 30% lower?",
         "I just found out my hotel is near Cais do Sodré. Does that change any of your suggestions?"),
        {"days": ("five", "six", "seven"), "month": ("April", "May", "October"), "budget": ("600", "700", "800")},
    ),
    Topic(
        "first 10k run",
        (
            ("I want to run my first 10k in {weeks} weeks. Right now I can jog about 3 km before I need to stop. Where do "
             "I start?",
             "That is a good starting point and {weeks} weeks is enough time. Run three times a week, never on two days "
             "in a row. Keep most runs at an easy, conversational pace: if you cannot speak in full sentences, slow "
             "down. Add distance gradually, about 10% a week, and make one of the three runs a little longer than the "
             "others. Walking breaks are fine; they are part of the plan, not a failure."),
            ("My knees ache a bit after running. Should I worry?",
             "Mild aching that fades within a day is common when you start, but sharp pain, swelling, or pain that gets "
             "worse while running is a signal to stop and see a professional. Check your shoes first: worn or "
             "unsuitable shoes are a frequent cause. Shorter, quicker steps reduce the impact on the knees. Strength "
             "work for the hips and thighs twice a week, such as squats, lunges and glute bridges, helps a lot."),
            ("What should I eat before a run?",
             "For an easy run under an hour you do not need anything special. If you run in the morning, a banana or a "
             "slice of toast with honey 30 to 60 minutes before is enough. Avoid heavy, fatty or very high-fibre meals "
             "in the two hours before. Drink water normally through the day; for runs under an hour you do not need "
             "sports drinks."),
            ("Is it bad that I'm so slow? I run about 7:30 per kilometre.",
             "Not at all. Pace does not matter for your first 10k; finishing comfortably does. Most of your training "
             "should feel easy anyway, because easy running builds the aerobic base that makes you faster later. At "
             "7:30 per kilometre you would finish in about 75 minutes, which is a perfectly respectable first race."),
            ("Should I do any speed work?",
             "Once you can run 5 km without stopping, you can add one session a week with short pickups: after a "
             "warm-up, run 6 to 8 bursts of 30 seconds a little faster than your usual pace, with a minute or two of "
             "easy jogging in between. Keep it playful. Do not add speed work and a longer long run in the same week."),
        ),
        ("Can you write me a week-by-week plan for the {weeks} weeks, based on everything above?",
         "The race is on a Sunday. What should I do in the last week and on race morning?",
         "I missed a whole week because of a cold. How do I get back on track without overdoing it?"),
        {"weeks": ("eight", "ten", "twelve")},
    ),
    Topic(
        "slow SQL query",
        (
            ("Our orders page got slow. This query takes {seconds} seconds on PostgreSQL:\n\n"
             "SELECT o.id, o.created_at, c.name, o.total\nFROM orders o\nJOIN customers c ON c.id = o.customer_id\n"
             "WHERE o.status = 'open' AND o.created_at > now() - interval '30 days'\nORDER BY o.created_at DESC\nLIMIT 50;\n\n"
             "The orders table has about {rows} rows. What should I look at first?",
             "Start with the plan: run the query with EXPLAIN (ANALYZE, BUFFERS) and look for a sequential scan on "
             "orders, and for a big sort before the LIMIT. With that many rows, a query that filters on status and "
             "created_at and sorts by created_at usually wants an index that matches both the filter and the order. "
             "Also check that customers.id is the primary key, so the join is a cheap index lookup."),
            ("The plan shows a Seq Scan on orders with Filter: status = 'open' and a Sort. What index would help?",
             "A composite index on (status, created_at DESC) lets PostgreSQL jump to the open orders and read them "
             "already in date order, so it can stop after 50 rows instead of sorting everything:\n\n"
             "CREATE INDEX CONCURRENTLY orders_status_created_idx ON orders (status, created_at DESC);\n\n"
             "CONCURRENTLY avoids locking the table against writes while it builds, which matters on a busy "
             "production table. If only a small share of orders are open, a partial index is even smaller: "
             "CREATE INDEX ... ON orders (created_at DESC) WHERE status = 'open';"),
            ("I created the partial index but the planner still does a Seq Scan.",
             "A few things to check. First, run ANALYZE orders so the statistics are current; the planner may think "
             "most orders are open. Second, the WHERE clause in the query must match the index predicate exactly, "
             "status = 'open' with the same type; a parameter that the planner cannot see at planning time can prevent "
             "a partial index from being used. Third, compare the estimated and actual row counts in EXPLAIN ANALYZE; "
             "a large mismatch points to stale or insufficient statistics."),
            ("After ANALYZE it uses the index and takes 4 ms. Should I add indexes for every slow query now?",
             "Not blindly. Every index slows down inserts and updates a little and takes disk and memory, and unused "
             "indexes are pure cost. Use pg_stat_statements to find the queries that take the most total time, fix "
             "those first, and periodically check pg_stat_user_indexes for indexes with idx_scan = 0. Prefer a few "
             "well-chosen composite indexes over many single-column ones."),
        ),
        ("We also have a report that counts open orders per customer for the last year. How would you make that fast?",
         "Can you summarise what we did here as a short checklist for my team's wiki?",
         "Would any of this be different on MySQL instead of PostgreSQL?"),
        {"seconds": ("4", "6", "9"), "rows": ("12 million", "30 million", "8 million")},
    ),
    Topic(
        "home Wi-Fi",
        (
            ("The Wi-Fi in our {rooms}-room flat is terrible in the bedroom at the far end. The router is in the hallway "
             "by the front door. What can I do?",
             "First check where the weak spot really is: a free Wi-Fi analyser app on a phone shows the signal "
             "strength in each room. Walls, especially brick, concrete and anything with metal or water (radiators, "
             "fish tanks, bathrooms) absorb a lot of signal. Moving the router higher and more central often helps "
             "more than any gadget, so see whether the line can be extended to a more central spot."),
            ("I can't move the router; the fibre box is there. Should I buy a repeater?",
             "A plain repeater is the cheapest option, but it usually halves the speed because it receives and "
             "resends on the same radio, and devices often cling to the weaker network. A mesh system with two or "
             "three units is better: they hand devices over between units and use one network name. If you can run a "
             "cable, powerline adapters or an Ethernet cable to a second access point give the best speed of all."),
            ("What's the difference between 2.4 GHz and 5 GHz? My router shows both.",
             "2.4 GHz reaches further and passes through walls better, but it is slower and crowded, since "
             "neighbours, Bluetooth and microwaves share it. 5 GHz is much faster but fades quickly through walls. "
             "Many routers can use one name for both and steer devices automatically. For a distant bedroom, 2.4 GHz "
             "may be the one that works at all, while 5 GHz is best near the router."),
            ("Does the channel matter? The app says there are {networks} networks around.",
             "It can matter a lot in a block of flats. On 2.4 GHz, only channels 1, 6 and 11 do not overlap, so pick "
             "the least busy of those three rather than something in between. On 5 GHz there are many more channels "
             "and less overlap. Most routers have an automatic setting, but it is worth checking after a restart; "
             "sometimes auto picks a crowded channel."),
            ("I bought a two-unit mesh kit. Where should the second unit go?",
             "Roughly halfway between the router and the problem room, not inside the problem room itself. The "
             "satellite needs a good signal from the main unit to pass on; if it sits where the signal is already "
             "poor, it can only relay a poor connection. Most kits have an app that shows the link quality between "
             "units; aim for \"good\" or better, and keep the units out of cupboards and away from the floor."),
        ),
        ("The mesh works, but my work laptop keeps dropping video calls. What could still be wrong?",
         "Can you write the steps we went through as a short guide for my parents, who have the same problem?",
         "Is it worth paying for a faster internet plan now, or is Wi-Fi still the bottleneck?"),
        {"rooms": ("three", "four", "five"), "networks": ("14", "22", "31")},
    ),
    Topic(
        "vegetarian lasagna",
        (
            ("I'm making a vegetarian lasagna for {guests} people on Saturday. I've never made lasagna. Any advice?",
             "Lasagna is forgiving, so don't worry. You need three components: a vegetable filling or ragù, a béchamel "
             "(white sauce), and the pasta sheets, plus cheese for the top. A good vegetarian filling is lentils or "
             "mushrooms cooked slowly with onion, garlic, carrot, tomato and herbs, so it has the depth of a meat "
             "sauce. Make the filling the day before; it tastes better and the assembly is quicker."),
            ("How much béchamel do I need and how do I make it without lumps?",
             "For a large dish, use about 60 g butter, 60 g flour and 800 ml milk. Melt the butter, stir in the flour "
             "and cook for a minute or two, then add the milk a little at a time, whisking constantly, and only add "
             "more when the sauce is smooth again. Warm milk makes it easier. Season with salt, pepper and a pinch of "
             "nutmeg. If lumps appear, whisk hard or pass it through a sieve."),
            ("Do I need to boil the pasta sheets first?",
             "With fresh sheets or \"no boil\" dried sheets, no. Just make sure the sauces are quite loose, because "
             "the pasta absorbs liquid while baking; a dry filling gives hard, chewy edges. With ordinary dried "
             "sheets, boil them for two or three minutes in batches and lay them on an oiled tray so they don't stick "
             "together."),
            ("One guest is lactose intolerant. Can I adapt it?",
             "Yes. You can make the béchamel with olive oil instead of butter and an unsweetened plant milk such as oat "
             "or soy. For the top, lactose-free mozzarella melts well, or use a breadcrumb and herb crust instead of "
             "cheese. Hard aged cheeses like parmesan contain very little lactose, so ask your guest whether they "
             "tolerate a small amount. Alternatively, bake a small separate dish just for them."),
            ("How long should it bake and can I assemble it in the morning?",
             "Assembling in the morning is fine: cover it and keep it in the fridge, then add 10 to 15 minutes to the "
             "baking time because it starts cold. Bake at 180 °C, covered with foil for the first 30 minutes and "
             "uncovered for 15 to 20 minutes until the top is golden and bubbling. Let it rest for 15 minutes before "
             "cutting, or the layers will slide apart."),
        ),
        ("What should I serve with it, and what can I prepare ahead so I'm not stuck in the kitchen?",
         "Can you turn all of this into a shopping list for {guests} people?",
         "I only have a square 24 cm dish. How should I change the amounts and the timing?"),
        {"guests": ("six", "eight", "ten")},
    ),
    Topic(
        "emergency fund",
        (
            ("I'm {age}, I earn about {salary} a month after tax and I have almost no savings. Everyone says I need an "
             "emergency fund. How big should it be?",
             "The usual guideline is three to six months of essential expenses, not of income. Essential means rent, "
             "utilities, food, transport, insurance and minimum debt payments. If your job is stable and you have no "
             "dependants, three months is a reasonable first target; if your income varies or you support others, aim "
             "for six. A first milestone of one month already makes a big difference."),
            ("My essentials are about {essentials} a month. That seems like a lot to save.",
             "It is a big number, so break it down. Automate a fixed transfer on payday, even a modest amount, so the "
             "money leaves your current account before you can spend it. Put windfalls such as a tax refund or a bonus "
             "straight into the fund. Review your subscriptions and recurring costs; people often find a surprising "
             "amount there. Progress matters more than speed."),
            ("Where should I keep it? My bank's savings account pays almost nothing.",
             "It should be safe and easy to reach within a day or two, so not in shares, which can drop just when you "
             "need the money. Look for an easy-access savings account with a competitive rate, ideally at a separate "
             "bank so it is not visible every time you check your current account. Make sure the deposit is covered "
             "by your country's deposit guarantee scheme."),
            ("I also have a credit card balance of {debt}. Should I pay that first?",
             "A common approach is to build a small starter fund first, perhaps one month of essentials, so that a "
             "surprise expense does not go back on the card, and then put everything extra toward the card, because "
             "its interest rate is almost certainly much higher than what savings earn. Once the card is cleared, "
             "redirect that payment into the emergency fund."),
        ),
        ("Can you make me a month-by-month plan with the numbers I gave you?",
         "What actually counts as an emergency? I don't want to raid the fund for the wrong things.",
         "My partner and I are moving in together. How should we handle emergency savings as a couple?"),
        {"age": ("24", "29", "35"), "salary": ("2,100 euros", "2,600 euros", "3,200 euros"),
         "essentials": ("1,400", "1,650", "1,900"), "debt": ("1,200 euros", "2,500 euros", "900 euros")},
    ),
    Topic(
        "undoing a git mistake",
        (
            ("Help, I committed a file with a password to my feature branch and pushed it. The branch is called "
             "{branch}. What do I do?",
             "First, treat the password as leaked: change it now, before anything else. Removing it from git does not "
             "undo the exposure, because anyone who fetched the branch, and any CI logs or caches, may have it. Then "
             "clean the history. Has anyone else based work on this branch, or is it only yours?"),
            ("Only mine, and it's the last commit.",
             "Then it is simple. Remove the file from the commit and rewrite it:\n\n"
             "git rm --cached config/secrets.env\necho config/secrets.env >> .gitignore\ngit add .gitignore\n"
             "git commit --amend --no-edit\ngit push --force-with-lease origin {branch}\n\n"
             "--force-with-lease refuses to overwrite the remote if someone pushed in the meantime, which makes it "
             "safer than plain --force. The file stays on your disk; only git stops tracking it."),
            ("What if it had been three commits ago?",
             "Then use an interactive rebase: git rebase -i HEAD~4, mark the commit that added the file as \"edit\", "
             "and when the rebase stops there, run git rm --cached on the file, git commit --amend, and git rebase "
             "--continue. If the file appears in many commits, or across branches, a tool like git filter-repo can "
             "remove it from the whole history in one pass."),
            ("Is the old commit really gone from GitHub after the force push?",
             "Not necessarily. The commit is no longer on any branch, but it can still be reachable by its hash for a "
             "while, and it may appear in forks, pull request pages or cached views. That is why rotating the secret "
             "is the real fix. If the repository is public or the secret was sensitive, contact the hosting "
             "provider's support to purge cached views."),
        ),
        ("How can I stop this from happening again? Something automatic would be ideal.",
         "My colleague says I should have used git revert instead. Who is right?",
         "Can you explain what --force-with-lease actually checks, step by step?"),
        {"branch": ("feature/login-page", "fix/payment-retry", "feat/export-csv")},
    ),
    Topic(
        "dying houseplants",
        (
            ("My {plant} is dropping leaves and some are turning yellow. It's about a metre from a {window} window. "
             "What's wrong?",
             "Yellowing and dropping leaves are usually about water or light, and overwatering is the most common "
             "cause indoors. Push a finger into the soil: if it is wet a few centimetres down several days after "
             "watering, the roots may be sitting in water. Check that the pot has drainage holes and that no water "
             "stands in the outer pot or saucer. A sudden change of place or a cold draught can also cause leaf drop."),
            ("I water it every Sunday with a full glass. The soil does feel damp.",
             "A fixed weekly schedule is a common trap, because a plant's needs change with the season, the light and "
             "the temperature. Water when the top few centimetres of soil are dry instead, then water thoroughly until "
             "it runs out of the bottom and empty the saucer after half an hour. In winter that may be every two or "
             "three weeks. Let the soil dry out now before you water again."),
            ("Should I repot it? The roots are coming out of the bottom.",
             "Roots growing out of the drainage holes mean it is probably root-bound, but do not repot a stressed "
             "plant in the middle of winter. Wait until spring, then move it to a pot only 2 to 5 cm wider, with fresh "
             "potting mix. When you repot, look at the roots: healthy ones are firm and pale, rotten ones are brown, "
             "mushy and smell bad, and should be cut off."),
            ("Is the light enough? The {window} window gets {light}.",
             "For most common houseplants, bright indirect light is ideal. Direct midday sun through glass can scorch "
             "leaves, while too little light makes plants leggy and pale and slows their use of water, which makes "
             "overwatering more likely. If the leaves lean strongly toward the window, it wants more light; turning "
             "the pot a quarter turn each week keeps growth even."),
        ),
        ("Can you give me a simple care routine for the next two months, based on what I told you?",
         "I also have a cactus on the same windowsill. Does any of this advice change for it?",
         "Should I use fertiliser to help it recover?"),
        {"plant": ("fiddle-leaf fig", "peace lily", "rubber plant"), "window": ("north-facing", "east-facing", "west-facing"),
         "light": ("only a bit of morning sun", "strong afternoon sun", "no direct sun at all")},
    ),
)

CALIBRATION_TOPICS = (
    Topic(
        "sourdough starter",
        (
            ("I started a sourdough starter {days} days ago with rye flour and water. It bubbled a lot on day two and "
             "now it barely does anything. Did I kill it?",
             "Almost certainly not. That early burst of activity usually comes from bacteria that do not last; once "
             "the mixture becomes more acidic they die back, and the wild yeast and lactic acid bacteria you want take "
             "a few more days to establish. A quiet phase between days three and seven is normal. Keep feeding it on "
             "schedule and keep it somewhere warm, around 24 to 26 °C."),
            ("How should I feed it?",
             "Once a day, discard all but about 50 g, then add 50 g flour and 50 g water, and stir well. Discarding "
             "feels wasteful, but it keeps the quantity manageable and gives the microbes enough fresh food. Use "
             "unbleached flour; a mix of rye and white bread flour works well. If your tap water is heavily "
             "chlorinated, let it stand for a few hours or use filtered water."),
            ("There's a grey liquid on top. Is that mould?",
             "That liquid is called hooch: alcohol produced by the yeast when it is hungry. It is harmless. Pour it off "
             "for a milder flavour or stir it in for a more sour one, and consider feeding a bit more often. Mould "
             "looks different: fuzzy spots of white, green, pink or black on the surface. Pink or orange streaks mean "
             "you should throw it away and start again."),
            ("How do I know when it's ready to bake with?",
             "A mature starter reliably doubles in size within four to eight hours of a feeding, has lots of bubbles "
             "throughout, and smells pleasantly sour, a bit like yoghurt. When it does that for three days in a row, "
             "it is ready. The float test, dropping a spoonful in water, is a rough guide, but rising predictably "
             "after feeding is the better sign."),
        ),
        ("Can you give me a simple first loaf recipe and timeline for a weekend, using my starter?",
         "I'm going on holiday for two weeks. How do I keep the starter alive while I'm away?",
         "My kitchen is only about {temp} °C. How should I adjust everything you said?"),
        {"days": ("five", "six", "four"), "temp": ("18", "19", "17")},
    ),
    Topic(
        "job interview",
        (
            ("I have a second-round interview for a {role} position on {day}. It's with the team lead and two "
             "engineers. How should I prepare?",
             "Congratulations on getting to the second round. Expect more depth than the first: questions about how "
             "you approached real problems, how you work with others, and probably a technical discussion. Re-read the "
             "job description and list the three or four skills they stress most, then prepare one concrete story "
             "from your experience for each. Also research the team's product so you can ask informed questions."),
            ("How do I structure those stories? I tend to ramble.",
             "A simple structure helps: the situation in one or two sentences, your task or goal, the actions you "
             "took, and the result, ideally with a number or a visible outcome. Spend most of the time on what you "
             "did, using \"I\" rather than \"we\". Practise out loud and time yourself; two minutes per story is "
             "plenty. End with what you learned, which often leads to a good follow-up question."),
            ("What if they ask about a weakness?",
             "Pick a real but manageable weakness, not a disguised strength such as \"I work too hard\". Say what it "
             "is, give a short example of how it affected your work, and describe what you are doing about it, with "
             "evidence of progress. For example: you used to avoid asking for help and lost time, so now you set "
             "yourself a time limit before asking, and your estimates have become more reliable."),
            ("Should I bring up salary?",
             "In most processes it is better to let them raise it, often with the recruiter rather than the team. If "
             "they ask for your expectations, give a range based on research for the role, the level and the city, "
             "with your target near the bottom of the range. Say that you are flexible depending on the full package, "
             "including holidays, training budget and remote work."),
        ),
        ("What questions should I ask them at the end? Give me a few that fit what we discussed.",
         "Can you run a short mock interview with me? Ask me the first question.",
         "The interview was moved to a video call. What changes?"),
        {"role": ("backend developer", "data analyst", "product designer"), "day": ("Thursday", "Monday", "Friday")},
    ),
    Topic(
        "learning Spanish",
        (
            ("I'm {age} and I want to learn Spanish before moving to Valencia in {months} months. I did a bit at "
             "school but remember almost nothing. Is it possible?",
             "Yes, you can get to a solid everyday level in that time if you practise most days. School Spanish helps "
             "more than you think; much of it comes back quickly. Aim for daily contact rather than long weekly "
             "sessions: 30 to 45 minutes a day beats a three-hour session on Sunday. Focus first on the language you "
             "will need in the first weeks: housing, shopping, the doctor, small talk with neighbours."),
            ("Apps or a teacher?",
             "Both have a place. Apps are good for vocabulary and for keeping a daily habit, but they rarely get you "
             "speaking. A teacher or a conversation partner, even once or twice a week online, forces you to produce "
             "sentences and corrects your mistakes. Since you are moving, also look for a language exchange: you help "
             "someone with English, they help you with Spanish."),
            ("The verbs scare me. There are so many tenses.",
             "You don't need them all at once. With the present tense, the near future (voy a + infinitive), and one "
             "past tense, the pretérito perfecto (he comido), you can already say a great deal. Learn the most common "
             "irregular verbs early: ser, estar, tener, ir, hacer, poder, querer, decir. Add the other past tenses once "
             "those feel natural."),
            ("I've heard they speak Valencian there too. Should I worry?",
             "Valencian, a variety of Catalan, is co-official in the region, and you will see it on signs and hear it "
             "in some families and towns. In the city of Valencia, Spanish is what you will use most of the time, and "
             "everyone speaks it. Learning a few Valencian greetings is a friendly gesture, but focus on Spanish first."),
        ),
        ("Can you make me a weekly study plan for the {months} months, based on what you suggested?",
         "What are ten phrases I will need in my first week there?",
         "How can I tell whether I'm actually making progress?"),
        {"age": ("31", "42", "55"), "months": ("six", "eight", "four")},
    ),
    Topic(
        "Docker port mapping",
        (
            ("I'm running a Flask app in Docker with `docker run -p {port}:5000 myapp`, but http://localhost:{port} "
             "says connection refused. The logs show `Running on http://127.0.0.1:5000`. What's wrong?",
             "The log line is the clue. Inside the container the app listens only on 127.0.0.1, the container's own "
             "loopback interface. Docker forwards traffic from your host's port to the container's network interface, "
             "not to its loopback, so nothing answers. Make the app listen on all interfaces: run `flask run --host "
             "0.0.0.0`, or call `app.run(host=\"0.0.0.0\")`."),
            ("That worked! But isn't 0.0.0.0 insecure?",
             "Inside the container it is fine, because the container has its own network namespace, and only the "
             "ports you publish with -p are reachable from outside. What you should watch is the host side: `-p "
             "{port}:5000` publishes on all host interfaces, so other machines on your network may reach it. To keep "
             "it on your machine only, use `-p 127.0.0.1:{port}:5000`."),
            ("Now I added a Postgres container and the app can't connect to localhost:5432.",
             "Same idea from the other side: inside the app container, localhost is the app container itself, not the "
             "database. Put both containers on the same user-defined network and use the database container's name as "
             "the host. With docker compose that happens automatically: a service called db is reachable at db:5432 "
             "from the other services."),
            ("Should I use docker compose for this then?",
             "Yes, for anything with more than one container it saves a lot of typing and mistakes. A compose file "
             "describes the services, their ports, environment variables, volumes and dependencies, and `docker "
             "compose up` starts them all on a shared network. Add a named volume for the database so your data "
             "survives when the container is recreated."),
        ),
        ("Can you write the docker-compose.yml for the app and the database, following what we discussed?",
         "The app starts before Postgres is ready and crashes. How do I handle that?",
         "How would I explain this localhost confusion to a new colleague in two or three sentences?"),
        {"port": ("8080", "8000", "5001")},
    ),
    Topic(
        "puppy training",
        (
            ("We got a {breed} puppy last week. She's {weeks} weeks old and bites our hands all the time. Is that "
             "normal?",
             "Very normal. Puppies explore with their mouths and they are teething, and play-biting is how they learn "
             "how hard they can bite. The goal is to teach her that human skin is not a toy. When she bites, stop "
             "playing, say a calm \"ouch\" and turn away for a few seconds, then offer a chew toy instead. Be "
             "consistent: everyone in the family should react the same way."),
            ("And house training? She has accidents every day.",
             "At her age her bladder is small, so take her out very often: after waking up, after eating or drinking, "
             "after play, and every hour or two in between. Go to the same spot and praise or reward her the moment "
             "she finishes outside. Do not punish accidents; clean them with an enzyme cleaner so the smell does not "
             "draw her back. Most puppies become reliable somewhere between four and six months."),
            ("Should we use a crate?",
             "A crate can help a lot, as long as it is a safe den and never a punishment. Make it comfortable, feed "
             "her meals in it, and start with short periods with the door open. Puppies rarely soil the place where "
             "they sleep, which helps with house training. As a rough rule, do not leave her in it for more hours "
             "than her age in months plus one, except overnight."),
            ("When can she go to puppy classes?",
             "Many classes accept puppies about a week after their first vaccinations; ask your vet, because it "
             "depends on the local disease risk. Socialisation matters a great deal between about three and fourteen "
             "weeks, so even before classes, let her meet calm vaccinated dogs and many different people, sounds and "
             "surfaces, always at her own pace."),
        ),
        ("Can you put together a daily routine for her, with feeding, toilet breaks, play and training?",
         "She cries in the crate at night. What should we do?",
         "Our neighbour says we should be stricter with her. Based on everything above, what would you answer?"),
        {"breed": ("labrador", "border collie", "beagle"), "weeks": ("nine", "ten", "eleven")},
    ),
    Topic(
        "JavaScript async",
        (
            ("Why does this print undefined?\n\nfunction getUser(id) {\n  fetch(`/api/users/${id}`)\n"
             "    .then(r => r.json())\n    .then(data => { return data; });\n}\nconsole.log(getUser({uid}));",
             "getUser does not return anything: the return inside the last then only returns from that arrow "
             "function, and the fetch chain runs later anyway. A function that uses fetch cannot give you the data "
             "synchronously. Return the promise, `return fetch(...).then(r => r.json());`, and use it with "
             "`getUser({uid}).then(user => console.log(user))`, or make it an async function and await it."),
            ("So with async/await it would be like this?\n\nasync function getUser(id) {\n"
             "  const r = await fetch(`/api/users/${id}`);\n  return r.json();\n}\nconst user = getUser({uid});",
             "Nearly. getUser is right, but an async function always returns a promise, so user is a promise here, "
             "not the data. You need `const user = await getUser({uid});` inside another async function, or at the "
             "top level of an ES module, where top-level await is allowed. Also check r.ok before parsing: fetch does "
             "not reject on HTTP errors like 404 or 500."),
            ("I need ten users. This is slow:\n\nfor (const id of ids) {\n  users.push(await getUser(id));\n}",
             "Each await waits for the previous request to finish, so the requests run one after another. Start them "
             "all and wait for all of them together: `const users = await Promise.all(ids.map(getUser));`. Keep in "
             "mind that Promise.all rejects as soon as one request fails; if you want every result, successful or "
             "not, use Promise.allSettled and check each result's status."),
            ("Won't 100 requests at once overload the server?",
             "It can. For large lists, limit the concurrency: process the ids in batches of, say, five to ten with "
             "Promise.all per batch, or use a small pool that keeps a fixed number of requests in flight. Libraries "
             "such as p-limit do this for you. Also ask whether the API offers a batch endpoint that returns many users "
             "in one request; that is usually the best fix."),
        ),
        ("Can you write the batched version we talked about, with error handling?",
         "How would I add a timeout so one slow request doesn't block everything?",
         "Can you summarise the three mistakes I made today, so I remember them?"),
        {"uid": ("42", "7", "1031")},
    ),
)
