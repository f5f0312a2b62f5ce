"""The training prompts' source: hand-written requests of many kinds, one per line, by category.

Each entry is one distinct request, written the way people ask: questions and orders, long and
short, polite and terse, in several languages, some with a passage to work on, some as a
conversation already under way. `make_prompts.py` turns them into `builtin_prompts.jsonl`
(training) and `indist_prompts.jsonl` (held-out entries of the same bank: the in-distribution
set). The out-of-template evaluation set, `everyday_prompts.jsonl`, is written separately and
shares nothing with this file.
"""
from __future__ import annotations

EXPLAIN = [
    "Why is the sky blue?",
    "How does a refrigerator keep food cold?",
    "What causes the seasons on Earth?",
    "Can you explain how vaccines train the immune system?",
    "What is the difference between weather and climate?",
    "How do airplanes stay in the air?",
    "Explain what a mortgage is, in simple terms.",
    "What does GDP measure, and what does it miss?",
    "How does a search engine decide which pages to show first?",
    "Why do we have leap years?",
    "What is machine learning? Keep it short.",
    "How do noise-cancelling headphones work?",
    "Why does ice float on water?",
    "What happens in the body when we sleep?",
    "explain blockchain like i'm five",
    "What is the difference between a virus and a bacterium?",
    "How does compound interest work? Give a small example.",
    "What is an index fund?",
    "Why do cats purr?",
    "How does a microwave oven heat food?",
    "What is the Pythagorean theorem used for in real life?",
    "What's the difference between RAM and storage on a computer?",
    "Explain what an API is to someone who doesn't program.",
    "Why do onions make you cry?",
    "How do tides work?",
    "What was the Renaissance, briefly?",
    "What is the difference between affect and effect?",
    "How does the stock market work?",
    "What is a calorie?",
    "Explain the rules of chess in a few sentences.",
    "Why is it important to stretch before exercise?",
    "What does a CPU actually do?",
    "How do solar panels turn sunlight into electricity?",
    "What is inflation and why do prices go up over time?",
    "What is DNS and why does the internet need it?",
]

HOW_TO = [
    "How do I get better at public speaking?",
    "What's a good way to start running if I've never run before?",
    "How can I stop procrastinating on my homework?",
    "How do I change a flat tire?",
    "Give me some advice for my first day at a new job.",
    "How should I prepare for a job interview tomorrow?",
    "What's the best way to learn to touch type?",
    "How do I make my houseplants stop dying?",
    "I can't fall asleep at night. Any tips?",
    "How do I remove a coffee stain from a white shirt?",
    "how do i back up my phone photos",
    "What should I pack for a three-day camping trip?",
    "How can I save money on groceries each month?",
    "How do I write a good cover letter?",
    "My laptop is running slowly. What can I check?",
    "How do I politely say no to extra work from my boss?",
    "What's a simple morning routine that helps productivity?",
    "How can I keep my kids entertained on a rainy day?",
    "How do I start learning to play the guitar?",
    "What should I do if I lock myself out of my house?",
    "How do I make a budget for the first time?",
    "Tips for studying for a math exam in one week?",
    "How do I clean a cast iron pan?",
    "How can I be a better listener?",
    "What's the right way to ask for a raise?",
]

MATH = [
    "A shirt costs $25 and is on sale for 20% off. What is the sale price?",
    "If a car travels 180 km in 2.5 hours, what is its average speed?",
    "I have 3 quarters, 4 dimes and 7 pennies. How much money is that?",
    "A recipe for 4 people uses 300 g of pasta. How much do I need for 10 people?",
    "What is 15% of 240?",
    "Tom is 3 times as old as his son. In 12 years he will be twice as old. How old is the son now?",
    "A rectangle is 8 m long and 5 m wide. What are its area and perimeter?",
    "Solve for x: 3x + 7 = 22.",
    "What is the average of 12, 18, 25 and 31?",
    "If I save $45 a week, how long until I have $1,000?",
    "A train leaves at 9:40 and arrives at 13:15. How long is the trip?",
    "How many seconds are there in a day?",
    "Convert 72 degrees Fahrenheit to Celsius.",
    "A pizza is cut into 12 slices. If Maria eats 1/4 of it and Sam eats 1/3, how many slices are left?",
    "What is the probability of rolling two sixes with two dice?",
    "Simplify the fraction 84/126.",
    "A tank holds 500 liters and leaks 4 liters per hour. How long until it is half empty?",
    "What is 17 squared minus 12 squared?",
    "If 5 workers build a wall in 8 days, how long do 10 workers take?",
    "Round 3.14159 to three decimal places and explain the rule.",
    "what's 1234 + 5678",
    "Is 221 a prime number?",
    "Find the next number: 2, 6, 12, 20, 30, ...",
    "A bike costs 480 euros. I pay a third now and the rest in 4 equal payments. How big is each payment?",
]

CODE = [
    "Write a Python function that checks if a year is a leap year.",
    "How do I read a CSV file in Python?",
    "What is the difference between a list and a tuple in Python?",
    "Write a SQL query that finds the five most expensive products in a table called products.",
    "Explain what this code does: `print([x * x for x in range(10) if x % 2 == 0])`",
    "Why does my JavaScript `for` loop with `var` print the same number five times inside setTimeout?",
    "Write a bash one-liner that counts the lines in every .txt file in a folder.",
    "How do I reverse a linked list? Show it in Java.",
    "What does `git rebase` do, compared with `git merge`?",
    "Fix this Python code: `def add(a, b) return a + b`",
    "Write a regular expression that matches an email address, and explain it.",
    "How do I sort a list of dictionaries by a key in Python?",
    "Write a function in JavaScript that debounces another function.",
    "What is Big O notation? Give examples.",
    "Write a C program that prints the numbers from 1 to 100, but Fizz for multiples of 3 and Buzz for multiples of 5.",
    "How do I make an HTTP GET request in Python?",
    "What is the difference between `==` and `===` in JavaScript?",
    "Write a Python class for a bank account with deposit and withdraw methods.",
    "Explain recursion with a short code example.",
    "How do I center a div in CSS?",
    "Write a Rust function that returns the largest number in a vector.",
    "What is a race condition and how do you avoid one?",
    "Convert this Python to JavaScript: `squares = {n: n ** 2 for n in range(5)}`",
    "Write unit tests for a function `is_even(n)` using pytest.",
    "my python script says IndentationError: unexpected indent. what does that mean?",
    "Write a Go function that reads a file and returns its number of words.",
    "What are the main differences between SQL and NoSQL databases?",
    "Write a Python script that renames all .jpeg files in a folder to .jpg.",
    "How does a hash map work internally?",
    "Write a TypeScript interface for a user with a name, an email and an optional age.",
]

WRITING = [
    "Write an email to my landlord asking to fix the heating.",
    "Draft a short message to a colleague thanking them for their help on a project.",
    "Write a polite email declining a meeting invitation.",
    "Write a LinkedIn post announcing that I started a new job as a data analyst.",
    "Write a note to my neighbour apologising for the noise at my party last night.",
    "Write a formal letter requesting a refund for a broken blender.",
    "Write a short product description for a stainless steel water bottle.",
    "Write a birthday message for my grandmother who is turning 90.",
    "Draft an out-of-office reply for my two-week vacation.",
    "Write a short speech for my best friend's wedding.",
    "Write a reminder email to the team about Friday's deadline.",
    "Write a complaint to an airline about lost luggage.",
    "Write a thank-you note to a teacher at the end of the school year.",
    "Write a two-sentence bio for a freelance photographer.",
    "Write a text inviting friends to a board game night on Saturday.",
]

CREATIVE = [
    "Write a haiku about the ocean.",
    "Write a limerick about a cat who loves cheese.",
    "Write a short poem about autumn leaves.",
    "Tell me a short story about a robot who learns to paint.",
    "Tell me a joke about computers.",
    "Write a four-line poem for a friend who is feeling down.",
    "Come up with five names for a coffee shop.",
    "Write a slogan for a bike repair shop.",
    "Write the opening paragraph of a mystery novel.",
    "Write a bedtime story about a sleepy dragon, for a four-year-old.",
    "Write a riddle whose answer is 'a shadow'.",
    "Describe a sunset over the mountains in three sentences.",
    "Write a short dialogue between a pirate and a librarian.",
    "Write a haiku about Monday mornings.",
    "Write song lyrics for a chorus about summer road trips.",
    "Invent a new holiday and describe how people celebrate it.",
    "Write a motivational quote about learning from mistakes.",
    "Write a tweet announcing a bakery's new cinnamon rolls.",
    "Write a short fable with a moral about patience.",
    "Write an acrostic poem for the word RAIN.",
]

EDIT = [
    "Summarize this in one sentence: The city council voted on Tuesday to expand the bike lane network "
    "by 40 kilometres over the next three years, citing rising cycling numbers and fewer accidents on "
    "streets that already have protected lanes.",
    "Fix the grammar: 'Me and him goes to the store yesterday and buyed three apple.'",
    "Make this sound more professional: 'hey, cant make it today, something came up, sorry'",
    "Shorten this: 'Due to the fact that the weather is extremely bad at this point in time, we have made "
    "the decision to postpone the picnic until a later date that is yet to be determined.'",
    "Rewrite this sentence in plain English: 'The utilization of the aforementioned methodology facilitated "
    "an enhancement in throughput.'",
    "Turn these notes into a paragraph: met client, wants redesign, budget 5k, deadline March, send draft "
    "next week.",
    "Summarize the plot of Romeo and Juliet in three sentences.",
    "Paraphrase: 'The early bird catches the worm.'",
    "Make this friendlier: 'Your request has been received and will be processed in due course.'",
    "Correct the spelling: 'I recieved the package and it was definately worth the wait, thier service is "
    "great.'",
    "Give this paragraph a title: 'Bees pollinate about a third of the crops we eat. Without them, foods "
    "like apples, almonds and blueberries would become rare and expensive.'",
    "Turn this into a bulleted list: buy milk, call the dentist, pay the electricity bill, pick up the kids "
    "at four.",
    "Rewrite this for a ten-year-old: 'Photosynthesis converts light energy into chemical energy stored in "
    "glucose.'",
    "Summarize: 'Remote work has grown sharply since 2020. Supporters say it saves commuting time and "
    "improves focus; critics say it weakens team culture and makes training new staff harder.'",
    "Make this headline catchier: 'Local Library Extends Opening Hours'",
]

TRANSLATE = [
    "Translate to French: 'Where is the nearest train station?'",
    "How do you say 'thank you very much' in Japanese?",
    "Translate into Spanish: 'I would like a table for two, please.'",
    "Translate this German sentence into English: 'Ich habe heute keine Zeit, aber morgen passt es gut.'",
    "What does 'carpe diem' mean?",
    "Translate to Italian: 'The museum opens at nine in the morning.'",
    "Translate 'Happy birthday, I hope all your wishes come true' into Portuguese.",
    "Translate from Spanish: 'Mañana vamos a la playa si no llueve.'",
    "How do I say 'Excuse me, how much does this cost?' in German?",
    "Translate to English: 'Je voudrais réserver une chambre pour trois nuits.'",
    "Translate 'good morning' into five languages.",
    "What is the Chinese word for 'friend', and how is it pronounced?",
]

MULTILINGUAL = [
    "¿Cuál es la capital de Australia?",
    "¿Me puedes dar una receta fácil de tortilla de patatas?",
    "Explique-moi la photosynthèse en quelques phrases.",
    "Quels sont les avantages du vélo pour aller au travail ?",
    "Wie viele Einwohner hat Berlin ungefähr?",
    "Kannst du mir drei Tipps zum Deutschlernen geben?",
    "Qual é a diferença entre 'mas' e 'mais' em português?",
    "Escreva uma frase de boas-vindas para um novo colega.",
    "Come si prepara un buon caffè espresso a casa?",
    "Scrivi una breve poesia sul mare.",
    "请用简单的话解释什么是人工智能。",
    "给我三个学习英语的建议。",
    "日本の首都はどこですか？",
    "Wat is het verschil tussen een meer en een zee?",
    "¿Por qué el cielo es azul? Responde en español.",
    "Écris un court message pour souhaiter un bon anniversaire à ma sœur.",
]

COMPARE = [
    "Should I learn Python or JavaScript first?",
    "What are the pros and cons of renting versus buying a home?",
    "Is it better to study in the morning or at night?",
    "Compare electric cars and hybrid cars.",
    "Tea or coffee: which is healthier?",
    "What are the advantages and disadvantages of working from home?",
    "iPhone or Android for an older parent?",
    "Compare cats and dogs as pets for a small apartment.",
    "What's the difference between a Roth IRA and a traditional IRA?",
    "Is a gym membership worth it, or can I get fit at home?",
    "Trains or planes for travelling across Europe?",
    "Paper books or e-readers: what are the trade-offs?",
]

LISTS = [
    "Give me ten ideas for a first date.",
    "List some healthy snacks I can bring to work.",
    "What are some fun things to do in Rome?",
    "Name five famous paintings and who painted them.",
    "Suggest some hobbies I can do at home.",
    "List the planets of the solar system in order.",
    "What are good gift ideas for a dad who likes cooking?",
    "Give me a list of classic movies everyone should watch.",
    "List six common interview questions.",
    "Brainstorm names for a fantasy kingdom.",
    "What vegetables grow well in pots on a balcony?",
    "List some quick exercises I can do at my desk.",
]

FACTS = [
    "Who wrote Pride and Prejudice?",
    "What is the tallest mountain in Africa?",
    "When did the first person walk on the Moon?",
    "How many bones are in the human body?",
    "What is the largest ocean on Earth?",
    "Who invented the telephone?",
    "What is the boiling point of water at the top of Mount Everest?",
    "Which planet has the most moons?",
    "What language is spoken in Brazil?",
    "How far is the Moon from the Earth?",
    "Who painted the Mona Lisa?",
    "What is the speed of light?",
    "What's the longest river in the world?",
    "How long does it take for light from the Sun to reach Earth?",
    "What is the chemical symbol for gold?",
    "Who was Ada Lovelace?",
    "What is the smallest country in the world?",
    "How many players are on a soccer team?",
    "Why did the Titanic sink?",
    "What is the capital of Canada?",
]

FOOD = [
    "Give me a simple recipe for banana bread.",
    "What can I cook with rice, eggs and spinach?",
    "How long should I boil an egg for a runny yolk?",
    "How do I make a basic vinaigrette?",
    "Suggest a vegetarian dinner that takes under 30 minutes.",
    "How do I make fluffy pancakes?",
    "What's a good substitute for buttermilk?",
    "Plan a week of simple lunches for work.",
    "How do I cook quinoa?",
    "Give me a recipe for a quick tomato soup.",
]

PLANNING = [
    "Plan a two-day trip to Paris for someone who loves art.",
    "Make me a weekly workout plan for a beginner.",
    "Create a study schedule for learning Spanish in three months.",
    "Help me plan a birthday party for a seven-year-old.",
    "Plan a relaxing Sunday.",
    "I have 2 hours before my flight. How should I spend the time at the airport?",
    "Make a packing checklist for a beach holiday.",
    "Outline the steps to launch a small online shop.",
]

CLASSIFY = [
    "Is this review positive or negative? 'The food was cold and the waiter ignored us for twenty minutes.'",
    "Extract the names and dates from this sentence: 'Maria met John on 12 March and again on 3 April.'",
    "Classify these animals as mammals, birds or reptiles: eagle, whale, lizard, bat, penguin, snake.",
    "What is the main topic of this sentence: 'Interest rates rose again, pushing mortgage costs higher.'?",
    "Return JSON with the fields name, age and city from: 'Lena is 34 and lives in Vienna.'",
    "Which of these words is the odd one out: apple, banana, carrot, cherry?",
    "Label each sentence as a fact or an opinion: 'Paris is in France.' 'Paris is the most beautiful city.'",
    "Find the keywords in: 'Our startup builds solar-powered chargers for hikers and campers.'",
    "Is this email spam? 'Congratulations! You won a free cruise. Click here to claim your prize now!'",
    "Sort these words alphabetically: zebra, mango, apple, kite, lemon.",
]

SYSTEMS = [
    "You are a helpful assistant.",
    "You are a helpful assistant. Answer clearly and concisely.",
    "You are a friendly tutor who explains things step by step.",
    "You are a concise assistant. Keep answers under 100 words.",
    "You are an expert software engineer.",
    "You are a cheerful assistant who likes to use simple words.",
    "Answer as briefly as possible.",
    "You are a careful assistant. If you are unsure, say so.",
]

SUFFIXES = ["", "", "", "", " Please keep it short.", " Explain your reasoning.", " Use a bulleted list.",
            " Answer in one paragraph.", " Thanks!", " Be specific."]

# Conversations under way: (user, assistant, user[, assistant, user]) turns.
CONVERSATIONS = [
    ["What's a good name for a golden retriever puppy?", "How about Sunny, Maple or Biscuit?",
     "I like Maple. Can you suggest a middle name to go with it?"],
    ["I want to learn to cook.", "Great! Start with simple dishes like omelettes, pasta and stir-fries.",
     "What should I cook first this weekend?"],
    ["What is 12 times 12?", "12 times 12 is 144.", "And what is 144 divided by 6?"],
    ["Write a Python function that adds two numbers.", "def add(a, b):\n    return a + b",
     "Now add type hints and a docstring."],
    ["Recommend a science fiction book.", "You might enjoy 'The Left Hand of Darkness' by Ursula K. Le Guin.",
     "I've read that one. Something more recent?"],
    ["Can you help me write an email to my teacher?", "Of course. What would you like the email to say?",
     "I need an extension on my essay because I was sick last week."],
    ["What's the capital of Spain?", "The capital of Spain is Madrid.", "What are three things to see there?"],
    ["I'm planning a trip to Japan.", "That sounds exciting! When are you going and for how long?",
     "Two weeks in April. What cities should I visit?"],
    ["Explain what a variable is in programming.",
     "A variable is a named place to store a value, like a labelled box.", "Can you show me one in JavaScript?"],
    ["Give me a word that rhymes with 'light'.", "Night.", "Now use both words in a short poem."],
    ["How many cups are in a liter?", "A liter is about 4.2 US cups.", "So how many cups is half a liter?"],
    ["I feel stressed about exams.",
     "That's very common. Would you like some tips for managing exam stress?", "Yes please, short ones."],
    ["Translate 'cat' into French.", "'Cat' in French is 'chat'.", "And 'dog'?",
     "'Dog' in French is 'chien'.", "Now make a sentence with both words."],
    ["What's the weather usually like in London in May?",
     "Mild: typically 12 to 18 degrees Celsius, with some rain.", "What should I pack?"],
    ["Summarize the benefits of exercise.",
     "Exercise improves heart health, mood, sleep and strength, and lowers the risk of many diseases.",
     "Make that into a short motivational message for my friend."],
    ["Je cherche un livre à lire.", "Quel genre aimez-vous ?", "Les romans policiers."],
    ["My code throws 'KeyError: name'.",
     "That means the dictionary has no key called 'name'. Can you share the code?",
     "data = {'Name': 'Ann'}\nprint(data['name'])"],
    ["Let's play twenty questions. I'm thinking of an animal.", "Is it a mammal?", "Yes.",
     "Does it live in the water?", "No. Ask your next question."],
]

# Requests that come with tools the model may call: (request, names of the tools offered).
TOOL_REQUESTS = [
    ("What's the weather in Lisbon right now?", ["get_weather"]),
    ("Do I need a jacket in Toronto this evening?", ["get_weather"]),
    ("How much is 1847 times 29? Use the calculator.", ["calculate"]),
    ("Convert 250 euros to Japanese yen.", ["convert_currency"]),
    ("Remind me to water the plants tomorrow at 8 am.", ["create_reminder"]),
    ("Is it raining in Nairobi? If so, remind me to take an umbrella at 7.", ["get_weather", "create_reminder"]),
    ("What's 15% of 3,460? Please calculate it exactly.", ["calculate", "convert_currency"]),
    ("I'm flying to Oslo. What's the temperature there in fahrenheit?", ["get_weather"]),
    ("How many US dollars is 1,000 Mexican pesos?", ["convert_currency", "calculate"]),
    ("Set a reminder for my dentist appointment on Monday at 3 pm.", ["create_reminder", "get_weather"]),
]
